"""Model runner speed beside transformers, on the same weights and dtype, in one process.

    .venv/bin/python benchmarks/model_runner.py [--dtype bfloat16] [--model-dir DIR] [--repeats 3]

Measures prefill of 1,024 tokens, decode at batch 1 (ms/token) and batch 16 (tokens/s), and time to
first token for a 1,000-token shared prefix + 50 new tokens, cold and with the prefix cached (the
prefix's blocks computed by an earlier request). Medians over `--repeats`. Targets on the 2-core dev
machine in float32: prefill >= transformers; batch-16 decode >= 4x transformers' batch 1; cached TTFT
>= 8x faster than cold.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from prefixcache.model_store.store import ensure_default_model
from prefixcache.step.messages import CachedRequestData, NewRequestData, SchedulerStep
from prefixcache.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
PREFILL_TOKENS = 1024
DECODE_CONTEXT = 128
DECODE_STEPS = 32
BATCH = 16
SHARED_PREFIX, SUFFIX = 1000, 50


def median_seconds(run: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_medians(ours: Callable[[], object], theirs: Callable[[], object], repeats: int,
                   ours_setup: Callable[[], object] = lambda: None,
                   their_setup: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """Median seconds of each side, the two measured alternately so that a load change hits both."""
    ours_times, their_times = [], []
    for _ in range(repeats):
        ours_times.append(median_seconds(ours, 1, ours_setup))
        their_times.append(median_seconds(theirs, 1, their_setup))
    return statistics.median(ours_times), statistics.median(their_times)


def random_tokens(count: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


class OurSide:
    """Drives the runner directly with hand-built steps (each request gets contiguous fresh blocks)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0
        self.next_block = 0

    def reset(self) -> None:
        self.runner.initialize_kv_cache(num_blocks=256, block_size=BLOCK_SIZE)
        self.next_block = 0

    def blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def execute(self, **fields) -> dict[str, int]:
        self.step_id += 1
        return self.runner.execute(SchedulerStep(self.step_id, **fields)).sampled_token_ids

    def prefill(self, prompts: dict[str, list[int]], cached_blocks: list[int] = ()) -> None:
        computed = len(cached_blocks) * BLOCK_SIZE
        new = [NewRequestData(rid, tokens, list(cached_blocks) + self.blocks(len(tokens) + DECODE_STEPS - computed),
                              computed) for rid, tokens in prompts.items()]
        self.execute(new_requests=new, num_scheduled_tokens={rid: len(t) - computed for rid, t in prompts.items()})

    def decode(self, prompts: dict[str, list[int]], steps: int) -> None:
        computed = {rid: len(tokens) for rid, tokens in prompts.items()}
        for _ in range(steps):
            cached = [CachedRequestData(rid, [], count) for rid, count in computed.items()]
            self.execute(cached_requests=cached, num_scheduled_tokens={rid: 1 for rid in computed})
            computed = {rid: count + 1 for rid, count in computed.items()}

    def finish(self, request_ids: list[str]) -> None:
        self.execute(finished_request_ids=request_ids)


class TheirSide:
    def __init__(self, model: transformers.PreTrainedModel) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, tokens: list[list[int]]) -> transformers.DynamicCache:
        cache = transformers.DynamicCache()
        self.model(torch.tensor(tokens), cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    @torch.inference_mode()
    def decode(self, cache: transformers.DynamicCache, batch: int, steps: int) -> None:
        inputs = torch.full((batch, 1), 42)
        for _ in range(steps):
            logits = self.model(inputs, cache=cache, use_cache=True).logits[:, -1]
            inputs = logits.argmax(dim=-1, keepdim=True)


Row = tuple[str, float, float, float, str]  # measure, ours, baseline, speed-up of ours, what the baseline is


def measure(ours: OurSide, theirs: TheirSide, vocab: int, repeats: int) -> list[Row]:
    rows: list[Row] = []
    prompt = random_tokens(PREFILL_TOKENS, 1, vocab)
    ours_time, their_time = paired_medians(lambda: ours.prefill({"prefill": prompt}), lambda: theirs.prefill([prompt]),
                                           repeats, ours_setup=ours.reset)
    rows.append((f"prefill {PREFILL_TOKENS} tokens (tok/s)", PREFILL_TOKENS / ours_time, PREFILL_TOKENS / their_time,
                 their_time / ours_time, "transformers; target >= 1x"))

    context = {f"decode-{i}": random_tokens(DECODE_CONTEXT, 100 + i, vocab) for i in range(BATCH)}
    single = dict(list(context.items())[:1])

    def ours_setup(prompts: dict[str, list[int]]) -> Callable[[], None]:
        return lambda: (ours.reset(), ours.prefill(prompts))

    caches: list[transformers.DynamicCache] = []

    def their_setup(prompts: dict[str, list[int]]) -> Callable[[], None]:
        return lambda: caches.append(theirs.prefill(list(prompts.values())))

    ours_b1, their_b1 = paired_medians(lambda: ours.decode(single, DECODE_STEPS),
                                       lambda: theirs.decode(caches[-1], 1, DECODE_STEPS), repeats,
                                       ours_setup(single), their_setup(single))
    rows.append((f"decode batch 1, context {DECODE_CONTEXT} (ms/token)", 1000 * ours_b1 / DECODE_STEPS,
                 1000 * their_b1 / DECODE_STEPS, their_b1 / ours_b1, "transformers batch 1"))
    ours_b16, their_b16 = paired_medians(lambda: ours.decode(context, DECODE_STEPS),
                                         lambda: theirs.decode(caches[-1], BATCH, DECODE_STEPS), repeats,
                                         ours_setup(context), their_setup(context))
    caches.clear()
    tokens = BATCH * DECODE_STEPS
    rows.append((f"decode batch {BATCH} (tok/s)", tokens / ours_b16, tokens / their_b16, their_b16 / ours_b16,
                 f"transformers batch {BATCH}"))
    rows.append((f"decode batch {BATCH} (tok/s)", tokens / ours_b16, DECODE_STEPS / their_b1,
                 tokens * their_b1 / (DECODE_STEPS * ours_b16), "transformers batch 1; target >= 4x"))

    prefix = random_tokens(SHARED_PREFIX, 7, vocab)
    full = prefix + random_tokens(SUFFIX, 8, vocab)
    hit_blocks = list(range(SHARED_PREFIX // BLOCK_SIZE))  # the prefix request's full blocks (allocated first)

    def compute_prefix() -> None:
        ours.reset()
        ours.prefill({"prefix": prefix})
        ours.finish(["prefix"])

    cold, their_cold = paired_medians(lambda: ours.prefill({"cold": full}), lambda: theirs.prefill([full]), repeats,
                                      ours_setup=ours.reset)
    cached, cold_again = paired_medians(lambda: ours.prefill({"hit": full}, cached_blocks=hit_blocks),
                                        lambda: ours.prefill({"cold": full}), repeats,
                                        ours_setup=compute_prefix, their_setup=ours.reset)
    name = f"TTFT {SHARED_PREFIX} shared + {SUFFIX} new ({len(hit_blocks) * BLOCK_SIZE} cached)"
    rows.append((f"{name}, cold (ms)", 1000 * cold, 1000 * their_cold, their_cold / cold, "transformers"))
    rows.append((f"{name}, prefix cached (ms)", 1000 * cached, 1000 * their_cold, their_cold / cached,
                 "transformers (no cache)"))
    rows.append((f"{name}, prefix cached (ms)", 1000 * cached, 1000 * cold_again, cold_again / cached,
                 "ours cold; target >= 8x"))
    return rows


def print_table(rows: list[Row], dtype: str, threads: int) -> None:
    print(f"\nprefixcache model runner, {dtype}, {threads} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"{'measure':<58} {'ours':>9} {'baseline':>9} {'speed-up':>9}  baseline")
    for name, ours, baseline, speedup, what in rows:
        print(f"{name:<58} {ours:>9.1f} {baseline:>9.1f} {speedup:>8.2f}x  {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the embedded SmolLM2 (pulled if needed)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)
    model_dir = args.model_dir or ensure_default_model()
    runner = ModelRunner(model_dir, dtype=args.dtype, num_threads=args.threads)
    torch.set_num_threads(args.threads)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    rows = measure(OurSide(runner), TheirSide(reference), runner.config.vocab_size, args.repeats)
    print_table(rows, args.dtype, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
