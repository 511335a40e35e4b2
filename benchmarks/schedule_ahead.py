"""Decode steps sent ahead against one step at a time, driving a real worker over gRPC (run by hand).

    .venv/bin/python benchmarks/schedule_ahead.py [--model-dir DIR] [--worker-cores 1] [--batch 8]

What `--schedule-ahead` changes at the worker: one step at a time, it idles between two steps for
the round trip and whatever the sender does; sent ahead, the next step is already waiting. This
drives a `prefixcache worker` directly with a batch of decodes over a shared prefix, both ways in
turn, and prints the time between two steps.

Where a GPU runs the steps, the host CPU is free while they run. The stand-in here is a worker pinned
to its own core (`--worker-cores`, the driver gets the others) serving a tiny random checkpoint whose
steps take about a millisecond (the default, made with transformers in a temporary folder). With
`--model-dir` and `--worker-cores all`, the worker shares every core with the driver, as a CPU
deployment does.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefixcache.launcher import free_port
from prefixcache.scheduler.engine import WorkerUnavailable
from prefixcache.scheduler.worker_client import GrpcStepExecutor
from prefixcache.step.messages import CachedRequestData, NewRequestData, SchedulerStep

BLOCK_SIZE = 16
STARTUP_TIMEOUT_S = 300.0


def save_tiny_checkpoint(out_dir: Path) -> Path:
    """A randomly initialised two-layer Llama (head size 64, so the native CPU kernels serve it)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                      eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


class DecodeDriver:
    """Builds the steps a scheduler would send: a shared prefix, `batch` requests on it, then decodes."""

    def __init__(self, executor: GrpcStepExecutor, vocab_size: int, batch: int, context: int) -> None:
        self.executor, self.vocab_size, self.batch, self.context = executor, vocab_size, batch, context
        self.step_id = -1
        self.computed: dict[str, int] = {}

    def _step(self, **fields) -> SchedulerStep:
        self.step_id += 1
        return SchedulerStep(self.step_id, **fields)

    async def start(self, decodes: int) -> None:
        """A fresh cache, the prefix, then every request's own 16 tokens after it."""
        await self.executor.initialize(BLOCK_SIZE)
        self.step_id = -1
        rng = random.Random(0)
        prefix = [rng.randrange(self.vocab_size) for _ in range(self.context)]
        prefix_blocks = list(range(self.context // BLOCK_SIZE))
        await self.executor.execute(self._step(new_requests=[NewRequestData("prefix", prefix, prefix_blocks, 0)],
                                               num_scheduled_tokens={"prefix": self.context}))
        own_blocks = -(-(BLOCK_SIZE + decodes + 1) // BLOCK_SIZE)
        new, next_block = [], len(prefix_blocks)
        for i in range(self.batch):
            tokens = prefix + [rng.randrange(self.vocab_size) for _ in range(BLOCK_SIZE)]
            blocks = prefix_blocks + list(range(next_block, next_block + own_blocks))
            next_block += own_blocks
            new.append(NewRequestData(f"r{i}", tokens, blocks, self.context))
        await self.executor.execute(self._step(new_requests=new, finished_request_ids=["prefix"],
                                               num_scheduled_tokens={r.request_id: BLOCK_SIZE for r in new}))
        self.computed = {f"r{i}": self.context + BLOCK_SIZE for i in range(self.batch)}

    def decode_step(self, ahead: bool) -> SchedulerStep:
        step = self._step(cached_requests=[CachedRequestData(rid, [], n) for rid, n in self.computed.items()],
                          num_scheduled_tokens={rid: 1 for rid in self.computed},
                          follows_step_id=self.step_id if ahead else None)
        self.computed = {rid: n + 1 for rid, n in self.computed.items()}
        return step

    async def intervals(self, decodes: int, ahead: bool) -> list[float]:
        """Seconds between consecutive step results, `decodes` steps, sent ahead or one at a time."""
        await self.start(decodes)
        stamps = []  # when each step's result arrived
        if ahead:
            in_flight = asyncio.ensure_future(self.executor.execute(self.decode_step(ahead=False)))
            for _ in range(decodes - 1):
                following = asyncio.ensure_future(self.executor.execute(self.decode_step(ahead=True)))
                await in_flight
                stamps.append(time.perf_counter())
                in_flight = following
            await in_flight
            stamps.append(time.perf_counter())
        else:
            for _ in range(decodes):
                await self.executor.execute(self.decode_step(ahead=False))
                stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]


def start_worker(model_dir: Path, port: int, cores: set[int] | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "prefixcache.cli.main", "worker", "--host", "127.0.0.1", "--port",
               str(port), "--model-dir", str(model_dir), "--kv-cache-memory", "256MiB", "--log-level", "WARNING"]
    return subprocess.Popen(command, preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)


async def wait_for_worker(executor: GrpcStepExecutor, worker: subprocess.Popen) -> int:
    """The model's vocabulary size, once the worker answers."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with status {worker.returncode}")
        try:
            return (await executor.initialize(BLOCK_SIZE)).vocab_size
        except (WorkerUnavailable, RuntimeError):
            if time.monotonic() > deadline:
                raise SystemExit("the worker did not come up in time") from None
            await asyncio.sleep(0.5)


async def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, list[float]]:
    all_cores = os.sched_getaffinity(0)
    worker_cores = None if args.worker_cores == "all" else {int(c) for c in args.worker_cores.split(",")}
    if worker_cores is not None and not worker_cores < all_cores:
        raise SystemExit(f"--worker-cores {args.worker_cores}: leave the driver at least one of {sorted(all_cores)}")
    port = free_port()
    worker = start_worker(model_dir, port, worker_cores)
    if worker_cores is not None:
        os.sched_setaffinity(0, all_cores - worker_cores)
    executor = GrpcStepExecutor(f"127.0.0.1:{port}")
    try:
        vocab_size = await wait_for_worker(executor, worker)
        driver = DecodeDriver(executor, vocab_size, args.batch, args.context)
        medians: dict[str, list[float]] = {"sent ahead": [], "one at a time": []}
        await driver.intervals(min(args.steps, 10), ahead=False)  # warm-up
        for _ in range(args.repeats):  # interleaved, so the VM's drift lands on both
            for mode in medians:
                medians[mode].append(statistics.median(await driver.intervals(args.steps, mode == "sent ahead")))
        return medians
    finally:
        await executor.close()
        worker.terminate()
        worker.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a Hugging Face checkpoint (default: a tiny random one)")
    parser.add_argument("--worker-cores", default="1",
                        help="CPU ids for the worker, comma-separated, or 'all' to share every core with the driver")
    parser.add_argument("--batch", type=int, default=8, help="decodes per step")
    parser.add_argument("--context", type=int, default=256, help="shared prefix, tokens (a multiple of 16)")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved")
    args = parser.parse_args()
    if args.context <= 0 or args.context % BLOCK_SIZE:
        parser.error(f"--context must be a positive multiple of {BLOCK_SIZE}")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or save_tiny_checkpoint(Path(scratch) / "tiny-llama")
        medians = asyncio.run(measure(args, model_dir))
    print(f"\nworker on cores {args.worker_cores}, model {model_dir.name if args.model_dir else 'tiny random Llama'}, "
          f"{args.batch} decodes per step after {args.context} shared tokens; medians of {args.steps} steps per run")
    print(f"{'mode':<14} {'ms per step, each run':<28} {'median':>7}")
    for mode, runs in medians.items():
        print(f"{mode:<14} {', '.join(f'{1e3 * m:.2f}' for m in runs):<28} {1e3 * statistics.median(runs):7.2f}")
    ratio = statistics.median(medians["one at a time"]) / statistics.median(medians["sent ahead"])
    print(f"steps per second, sent ahead / one at a time: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
