"""prefixcache against Hugging Face transformers `generate` on the same weights, in one run.

transformers serves one request at a time with a fresh KV cache each (no reuse across requests);
prefixcache runs the same requests with its cache and, on a fresh server, without it. Prints one
table per workload and checks the issue's targets:

- shared-system-prompt: TTFT p50 at least 8x lower with the cache than without;
- shared-system-prompt and multi-turn: request throughput at least 3x that of transformers;
- unique: request throughput with the cache within 5% of without.

Run by hand (minutes on two cores), from the repository root:

    .venv/bin/python benchmarks/vs_transformers.py --num-requests 16 --json vs_transformers.json

Without --target it starts local platforms itself, as `prefixcache bench` does, both at once. Each
workload runs through the three systems back to back, the order rotating from one workload to the
next, so that a drift in this VM's speed over minutes lands on every side rather than on whichever
ran last. Single runs still vary: `unique` with / without the cache read 0.84x in one interleaved
run and 0.91x to 1.14x in five back-to-back pairs on the same VM. Both sides run the weights in
float32 by default (the dtype the local platform reports is printed next to the table).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from prefixcache.rpc.fork_handlers import turn_off_grpc_fork_handlers

turn_off_grpc_fork_handlers()  # before grpc is imported: this process starts local services

from side_by_side import ComparedSystem, render_systems, run_interleaved

from prefixcache.bench.engine import EngineEndpoint
from prefixcache.bench.local_platform import LocalSettings
from prefixcache.bench.metrics import RequestRecord, RunSummary, ratio
from prefixcache.bench.report import CACHE, NO_CACHE, WorkloadResult
from prefixcache.bench.session import (
    BenchConfig,
    BenchOutcome,
    check_comparable,
    check_mode,
    engine_target,
    plan_workloads,
    warm_up,
)
from prefixcache.bench.workloads import BenchRequest, IntRange, WorkloadOptions
from prefixcache.cli.bench import int_range_argument
from prefixcache.model_store.store import ensure_default_model

WORKLOADS = ("shared-system-prompt", "multi-turn", "unique")
TRANSFORMERS = "transformers"
OURS = {CACHE: "prefixcache", NO_CACHE: "prefixcache-no-cache"}


class TransformersEndpoint:
    """`model.generate` behind the driver's endpoint interface: greedy, exactly max_tokens tokens
    (EOS suppressed, as prefixcache's `ignore_eos`), one request at a time."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self._model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self._one_at_a_time = asyncio.Lock()

    async def evictions(self) -> int:
        return 0

    async def stream(self, request: BenchRequest, salt: str, clock: Callable[[], float]) -> RequestRecord:
        async with self._one_at_a_time:
            return await asyncio.to_thread(self._generate, request, clock)

    def _generate(self, request: BenchRequest, clock: Callable[[], float]) -> RequestRecord:
        from transformers.generation.streamers import BaseStreamer

        record = RequestRecord(request_id=request.request_id, sent_s=clock())

        class TokenTimes(BaseStreamer):
            prompt_seen = False

            def put(self, value) -> None:  # the first call carries the prompt, then one token per call
                if self.prompt_seen:
                    record.chunks.append((clock(), value.numel()))
                self.prompt_seen = True

            def end(self) -> None:
                pass

        ids = self._torch.tensor([request.prompt_token_ids])
        with self._torch.inference_mode():
            self._model.generate(
                ids, attention_mask=self._torch.ones_like(ids), do_sample=False, max_new_tokens=request.max_tokens,
                min_new_tokens=request.max_tokens, streamer=TokenTimes(), pad_token_id=0,
            )
        record.finished_s = clock()
        record.prompt_tokens = len(request.prompt_token_ids)
        record.completion_tokens = sum(n for _, n in record.chunks)
        return record


async def run_all(config: BenchConfig, dtype: str) -> tuple[dict[str, object], dict[str, dict[str, RunSummary]]]:
    """Our engine with the cache and without it, and transformers, all up at once; each workload runs
    through the three back to back (`run_interleaved`), the same requests on each. Returns the run's
    description and the summaries by system, then workload."""
    async with contextlib.AsyncExitStack() as stack:
        targets = {}
        for mode in (CACHE, NO_CACHE):
            targets[mode] = await stack.enter_async_context(engine_target(config, mode))
        engines = {mode: await stack.enter_async_context(EngineEndpoint(target, config.request_timeout_s))
                   for mode, (target, _) in targets.items()}
        facts = {mode: check_mode(mode, await engine.facts(), targets[mode][0]) for mode, engine in engines.items()}
        check_comparable(facts[CACHE], facts[NO_CACHE], targets[NO_CACHE][0])
        outcome = BenchOutcome({name: WorkloadResult() for name in config.workloads})
        plan_workloads(config, facts[CACHE], outcome, note=_note)
        transformers = TransformersEndpoint(ensure_default_model(), dtype)
        first = next(iter(outcome.requests.values()))[0]
        await transformers.stream(replace(first, request_id="warmup", max_tokens=2), "", lambda: 0.0)  # first-call costs
        for engine in engines.values():
            await warm_up(engine, outcome.options, config.warmup_requests)
        systems = [ComparedSystem(OURS[mode], engines[mode], config.concurrency,
                                  engines[mode] if targets[mode][1] else None) for mode in (CACHE, NO_CACHE)]
        systems.append(ComparedSystem(TRANSFORMERS, transformers, concurrency=1))
        summaries = await run_interleaved(outcome.requests, systems, outcome.options.tenants, note=_note)
    return outcome.description, summaries


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def check_targets(summaries: dict[str, dict[str, RunSummary]]) -> list[tuple[str, float | None, float, bool]]:
    """(target, measured, required, met) for each of the issue's targets."""
    ours, off, hf = summaries[OURS[CACHE]], summaries[OURS[NO_CACHE]], summaries[TRANSFORMERS]
    checks = []

    def at_least(label: str, measured: float | None, required: float) -> None:
        checks.append((label, measured, required, measured is not None and measured >= required))

    ssp = "shared-system-prompt"
    at_least(f"{ssp}: TTFT p50 without / with cache", ratio(off[ssp].ttft_ms.p50, ours[ssp].ttft_ms.p50), 8.0)
    for name in ("shared-system-prompt", "multi-turn"):
        at_least(f"{name}: requests/s prefixcache / transformers",
                 ratio(ours[name].requests_per_s, hf[name].requests_per_s), 3.0)
    at_least("unique: requests/s with / without cache", ratio(ours["unique"].requests_per_s, off["unique"].requests_per_s), 0.95)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a running Engine with the cache on (default: local platforms)")
    parser.add_argument("--no-cache-target", help="with --target: the same deployment with prefix caching off")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="prefixcache's; transformers runs one at a time")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int_range_argument, default=IntRange(50, 200))
    parser.add_argument("--turns", type=int_range_argument, default=IntRange(4, 8))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="both sides' dtype (float32 or bfloat16)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="local platform's KV cache budget")
    parser.add_argument("--json", help="write every summary and the target checks here")
    args = parser.parse_args(argv)

    options = WorkloadOptions(num_requests=args.num_requests, seed=args.seed, output_len=args.output_len,
                              prefix_len=args.prefix_len, suffix_len=args.suffix_len, turns=args.turns)
    config = BenchConfig(workloads=WORKLOADS, options=options, concurrency=args.concurrency, target=args.target,
                         no_cache_target=args.no_cache_target, compare_no_cache=True,
                         local=LocalSettings(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory))
    description, summaries = asyncio.run(run_all(config, args.dtype))

    print(f"engine: {description.get('engine')}; transformers dtype {args.dtype}")
    print(render_systems(summaries, baseline=TRANSFORMERS))
    checks = check_targets(summaries)
    for label, measured, required, met in checks:
        shown = "-" if measured is None else f"{measured:.2f}x"
        print(f"{'MET ' if met else 'MISS'}  {label}: {shown} (target >= {required:.2f}x)")
    if args.json:
        document = {
            "config": description,
            "systems": {s: {w: summary.to_json() for w, summary in per.items()} for s, per in summaries.items()},
            "targets": [{"target": l, "measured": m, "required": r, "met": ok} for l, m, r, ok in checks],
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(met for *_, met in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
