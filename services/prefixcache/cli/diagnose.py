"""`prefixcache diagnose --target HOST:PORT [--window N] [--json FILE] [--plot FILE.png]`: is the prefix
cache thrashing, and how much KV memory would fix it?

Reads the scheduler's own record of its newest first lookups (the KvCache service's DiagnoseCache, not
traces): hit rate, prompt tokens missed by reason, the share evictions caused, the prefixes most often
looked up again after their eviction (by first-block hash, never text), how long blocks lived before
eviction, and the hit rate LRU caches of 0.25x to 4x the KV memory would have had over the same
lookups (exact, from stack distances). Ends with a one-line verdict. `--json FILE` (`-` for stdout)
writes the same as one object; `--plot` draws the hit rate against the memory factor.
"""
from __future__ import annotations

import argparse
import json
import sys

from prefixcache.arg_types import bounded_int
from prefixcache.cli.client_args import add_target, run_on_engine
from prefixcache.client import EngineClient
from prefixcache.protos.engine.v1 import kv_cache_pb2 as pb

INT64_MAX = 2**63 - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--window", type=bounded_int(0, INT64_MAX), default=0, metavar="N",
                        help="judge the newest N first lookups (default 0: every one the scheduler keeps)")
    parser.add_argument("--json", metavar="FILE", help="also write the diagnosis as one JSON object (- for stdout)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the hit rate against the KV memory factor")


def run(args: argparse.Namespace) -> int:
    diagnoses: list[pb.CacheDiagnosis] = []

    async def main(engine: EngineClient) -> int:
        diagnoses.append(await engine.diagnose(args.window))
        return 0

    code = run_on_engine(args, "diagnose", main)
    if code:
        return code
    [diagnosis] = diagnoses
    if args.json == "-":
        print(json.dumps(diagnosis_to_json(diagnosis)))
    else:
        print(report(diagnosis))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(diagnosis_to_json(diagnosis), out, indent=2)
                out.write("\n")
    if args.plot:
        plot(args.plot, diagnosis)
    return 0


def diagnosis_to_json(diagnosis: pb.CacheDiagnosis) -> dict[str, object]:
    return {
        "lookups": diagnosis.lookups,
        "max_window": diagnosis.max_window,
        "queried_tokens": diagnosis.queried_tokens,
        "hit_tokens": diagnosis.hit_tokens,
        "hit_rate": diagnosis.hit_rate,
        "miss_tokens": dict(sorted(diagnosis.miss_tokens.items())),
        "evicted_lookups": diagnosis.evicted_lookups,
        "evicted_miss_share": diagnosis.evicted_miss_share,
        "top_evicted_prefixes": [{"first_block_hash": p.first_block_hash.hex(), "count": p.count}
                                 for p in diagnosis.top_evicted_prefixes],
        "median_evicted_age_s": diagnosis.median_evicted_age_s if diagnosis.HasField("median_evicted_age_s") else None,
        "what_if": [{"memory_factor": w.memory_factor, "hit_rate": w.hit_rate} for w in diagnosis.what_if],
        "verdict": diagnosis.verdict,
        "recommended_memory_factor": (diagnosis.recommended_memory_factor
                                      if diagnosis.HasField("recommended_memory_factor") else None),
        "num_blocks": diagnosis.num_blocks,
        "block_size": diagnosis.block_size,
        "kv_bytes_per_token": diagnosis.kv_bytes_per_token,
    }


def report(diagnosis: pb.CacheDiagnosis) -> str:
    lines = [(f"the newest {diagnosis.lookups} first lookups (the scheduler keeps {diagnosis.max_window}); "
              f"KV cache of {diagnosis.num_blocks} blocks of {diagnosis.block_size} tokens"),
             (f"hit rate        {diagnosis.hit_rate:.1%} ({diagnosis.hit_tokens:,} of {diagnosis.queried_tokens:,} "
              "prompt tokens)"),
             "missed tokens   " + "  ".join(f"{reason} {tokens:,}" for reason, tokens in sorted(diagnosis.miss_tokens.items()))]
    evicted = f"evicted misses  {diagnosis.evicted_lookups} lookups, {diagnosis.evicted_miss_share:.1%} of the missed tokens"
    if diagnosis.HasField("median_evicted_age_s"):
        evicted += f"; their blocks had lived {diagnosis.median_evicted_age_s:.2f} s (median) when evicted"
    lines.append(evicted)
    if diagnosis.top_evicted_prefixes:
        lines.append("looked up again after eviction (first-block hash: times)")
        lines += [f"    {p.first_block_hash.hex()[:16]}  {p.count}" for p in diagnosis.top_evicted_prefixes]
    lines.append("what if (LRU)   " + "  ".join(f"{w.memory_factor:g}x {w.hit_rate:.0%}" for w in diagnosis.what_if))
    lines.append(f"verdict: {diagnosis.verdict}")
    return "\n".join(lines)


def plot(path: str, diagnosis: pb.CacheDiagnosis) -> None:
    try:
        import matplotlib
    except ImportError:
        print("error: --plot needs matplotlib (pip install prefixcache[bench])", file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4))
    axis.plot([w.memory_factor for w in diagnosis.what_if], [w.hit_rate for w in diagnosis.what_if], marker="o",
              label="LRU over the same lookups (exact)")
    axis.plot([1.0], [diagnosis.hit_rate], marker="*", markersize=14, linestyle="", label="measured")
    axis.set(title=f"{diagnosis.verdict.split(':')[0]}: hit rate against KV memory",
             xlabel="KV memory, relative to today's", ylabel="prompt-token hit rate", ylim=(-0.02, 1.02))
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
