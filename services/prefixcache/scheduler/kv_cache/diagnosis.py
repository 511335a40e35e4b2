"""What the last lookups say about the cache: hit rate, why tokens missed, and what more memory buys.

The what-if hit rates come from each lookup's stack distances (`stack_distance.py`): exact for an
LRU cache of that size over the same releases. The real pool departs from that model in two ways: blocks
held by running requests cannot be evicted (under concurrency it keeps a little more than the model
says), and a prompt matched in full recomputes its last block into a copy that takes a block until it
is evicted (a little less). The model's own hit rate at 1x, beside the measured one, shows how close
the two are.
"""
from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.scheduler.kv_cache.lookup_log import MISSED_TOKEN_REASONS, WHAT_IF_FACTORS, LookupRecord

# A larger budget is worth it when it would raise the hit rate by this much at least.
WORTHWHILE_GAIN = 0.05
# The budget to recommend gets within this much of what the largest what-if cache would hit.
NEAR_BEST = 0.01
# Evictions that cause this share of the missed tokens are thrash, whatever more memory would buy.
EVICTION_HEAVY = 0.25
TOP_PREFIXES = 10


@dataclass(frozen=True)
class Diagnosis:
    lookups: int
    queried_tokens: int
    hit_tokens: int
    miss_tokens: dict[str, int]  # by MISSED_TOKEN_REASONS
    evicted_lookups: int
    evicted_miss_share: float  # of the missed tokens, those missed because a block had been evicted
    top_evicted_prefixes: list[tuple[bytes, int]]  # first-block hash, evicted misses
    median_evicted_age_s: float | None  # of the missing blocks of the evicted misses, when evicted
    what_if: list[tuple[float, float]]  # (memory factor, hit rate)
    verdict: str
    recommended_factor: float | None  # the KV budget to raise to, relative to today's; None: no raise

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def diagnose(records: Sequence[LookupRecord], num_blocks: int, block_size: int, bytes_per_token: int = 0) -> Diagnosis:
    """`records`: the lookups to judge; `num_blocks` and `block_size`: the cache today; `bytes_per_token`:
    the KV memory one token takes (0 if unknown), to state the budget in bytes."""
    queried = sum(r.queried_tokens for r in records)
    hit = sum(r.hit_tokens for r in records)
    missed = dict.fromkeys(MISSED_TOKEN_REASONS, 0)
    for record in records:
        for reason, tokens in record.missed_tokens.items():
            missed[reason] = missed.get(reason, 0) + tokens
    evicted = [r for r in records if r.miss_reason == "evicted"]
    total_missed = sum(missed.values())
    share = missed["evicted"] / total_missed if total_missed else 0.0
    prefixes = Counter(r.first_block_hash for r in evicted if r.first_block_hash is not None)
    ages = [r.evicted_age_ns / 1e9 for r in evicted if r.evicted_age_ns is not None]
    what_if = [(factor, sum(r.what_if_hit_tokens[i] for r in records) / queried if queried else 0.0)
               for i, factor in enumerate(WHAT_IF_FACTORS)]
    verdict, factor = _verdict(what_if, share, num_blocks, block_size, bytes_per_token, bool(records))
    return Diagnosis(
        lookups=len(records), queried_tokens=queried, hit_tokens=hit, miss_tokens=missed,
        evicted_lookups=len(evicted), evicted_miss_share=share, top_evicted_prefixes=prefixes.most_common(TOP_PREFIXES),
        median_evicted_age_s=statistics.median(ages) if ages else None, what_if=what_if, verdict=verdict,
        recommended_factor=factor,
    )


def _verdict(what_if: list[tuple[float, float]], evicted_share: float, num_blocks: int, block_size: int,
             bytes_per_token: int, any_lookups: bool) -> tuple[str, float | None]:
    if not any_lookups:
        return "healthy: no lookups to judge yet", None
    rates = dict(what_if)
    largest = WHAT_IF_FACTORS[-1]
    today, best = rates[1.0], rates[largest]
    if best - today >= WORTHWHILE_GAIN:
        factor = min(f for f, rate in what_if if f > 1.0 and rate >= best - NEAR_BEST)
        budget = f"{round(factor * num_blocks)} blocks"
        if bytes_per_token:
            budget += f", {_bytes(factor * num_blocks * block_size * bytes_per_token)}"
        gain = f"the hit rate would go from {today:.0%} to {rates[factor]:.0%}"
        return f"thrashing: raise the KV budget to {factor:g}x ({budget}): {gain}", factor
    if evicted_share >= EVICTION_HEAVY:
        why = f"evictions cause {evicted_share:.0%} of the missed tokens"
        return (f"working set too large for any budget here: {why}, and even {largest:g}x the KV memory would "
                f"reach only {best:.0%}"), None
    return f"healthy: {largest:g}x the KV memory would raise the hit rate by {best - today:.0%} at most", None


def _bytes(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while count >= 1024 and power < len(units) - 1:
        count /= 1024
        power += 1
    return f"{count:.1f} {units[power]}"
