"""The diagnosis of a set of lookups: the figures, and which verdict they earn."""
from __future__ import annotations

import pytest

from prefixcache.scheduler.kv_cache import WHAT_IF_FACTORS, LookupLog, LookupRecord, diagnose


def record(hit: int, what_if: dict[float, int] | int, reason: str = "evicted", queried: int = 100,
           first_block: bytes | None = None, age_ns: int | None = None) -> LookupRecord:
    """A lookup of `queried` tokens (4 of them after the last full block) that hit `hit`."""
    per_factor = what_if if isinstance(what_if, dict) else {}
    default = what_if if isinstance(what_if, int) else hit
    hits = tuple(max((v for f, v in per_factor.items() if f <= factor), default=default) for factor in WHAT_IF_FACTORS)
    return LookupRecord(queried, hit, 0, 4, reason, hits, first_block if reason == "evicted" else None,
                        age_ns if reason == "evicted" else None)


def test_a_cache_more_memory_would_serve_is_thrashing_and_gets_the_smallest_budget_near_the_best() -> None:
    records = [record(0, {1.0: 0, 1.5: 48, 2.0: 96}, first_block=bytes([i % 3]), age_ns=(i + 1) * 10**9)
               for i in range(9)]
    diagnosis = diagnose(records, num_blocks=40, block_size=16, bytes_per_token=1024)
    assert diagnosis.hit_rate == 0 and diagnosis.evicted_miss_share == 96 / 100
    assert diagnosis.miss_tokens == {"cold": 0, "evicted": 9 * 96, "capped": 0, "partial_tail": 9 * 4}
    assert dict(diagnosis.what_if)[2.0] == pytest.approx(0.96) and dict(diagnosis.what_if)[1.5] == pytest.approx(0.48)
    assert diagnosis.recommended_factor == 2.0
    assert diagnosis.verdict == ("thrashing: raise the KV budget to 2x (80 blocks, 1.2 MiB): the hit rate would go "
                                 "from 0% to 96%")
    assert diagnosis.top_evicted_prefixes == [(b"\x00", 3), (b"\x01", 3), (b"\x02", 3)]
    assert diagnosis.median_evicted_age_s == 5.0


def test_evictions_no_budget_here_would_cure_are_a_working_set_too_large() -> None:
    records = [record(10, 12) for _ in range(5)]  # 4x would serve 2 tokens more of each
    diagnosis = diagnose(records, num_blocks=40, block_size=16)
    assert diagnosis.verdict.startswith("working set too large for any budget here: evictions cause 96% of the")
    assert diagnosis.recommended_factor is None


def test_cold_misses_that_memory_cannot_help_are_healthy() -> None:
    diagnosis = diagnose([record(50, 50, reason="cold") for _ in range(5)], num_blocks=40, block_size=16)
    assert diagnosis.verdict == "healthy: 4x the KV memory would raise the hit rate by 0% at most"
    assert diagnosis.evicted_lookups == 0 and diagnosis.median_evicted_age_s is None
    assert diagnose([], num_blocks=40, block_size=16).verdict == "healthy: no lookups to judge yet"


def test_the_log_counts_every_lookup_and_keeps_the_newest() -> None:
    log = LookupLog(window=3)
    for index in range(5):
        log.record(record(index, 80, reason="evicted" if index % 2 else "cold"))
    assert (log.lookups, log.evicted_lookups, log.ghost_hits) == (5, 2, 5)
    assert [r.hit_tokens for r in log.last(2)] == [3, 4] and [r.hit_tokens for r in log.last(10)] == [2, 3, 4]
    assert log.missed_tokens["partial_tail"] == 5 * 4
    assert log.missed_tokens["cold"] + log.missed_tokens["evicted"] == sum(96 - i for i in range(5))
