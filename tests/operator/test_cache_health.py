"""Cache health from two readings: rates over the interval (not since start), a restarted scheduler
gives no interval, an unread pod is listed and not counted, and CacheThrashing turns on only after
the share and the usage stay above their thresholds, and off again."""
from __future__ import annotations

from prefixcache.operator.admin_key import key_hash
from prefixcache.operator.cache_health import (
    CACHE_THRASHING,
    PodHealth,
    Reading,
    Thresholds,
    is_thrashing,
    pod_health,
    summary,
    thrashing_condition,
)
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.scheduler.tenancy import hash_api_key

THRESHOLDS = Thresholds(evicted_miss_share=0.5, kv_usage=0.8, intervals=2)


def reading(at: float, query: int, hit: int, evicted: int = 0, cold: int = 0, evictions: int = 0,
            used: int = 10, blocks: int = 100, cached: int = 40) -> Reading:
    stats = pb.CacheStats(query_tokens=query, hit_tokens=hit, evictions=evictions, num_blocks=blocks,
                          used_blocks=used, cached_blocks=cached,
                          missed_tokens_by_reason={"evicted": evicted, "cold": cold, "capped": 0})
    return Reading.from_stats(at, stats)


def test_rates_are_over_the_interval_not_since_start() -> None:
    before = reading(0, query=10_000, hit=9_000, cold=1_000, evictions=100)
    after = reading(30, query=11_000, hit=9_100, evicted=600, cold=1_300, evictions=160)  # 10% hits since `before`
    cache = summary([pod_health("engine-a", after, before)], 30)
    assert cache["hitRate"] == 0.1  # since start it would be 83%
    assert cache["evictionsPerMinute"] == 120.0
    assert cache["evictedMissShare"] == round(600 / 900, 4)
    assert (cache["podsRead"], cache["podsUnread"], cache["cachedBlocks"], cache["kvUsage"]) == (1, 0, 40, 0.1)


def test_a_first_reading_or_a_restart_has_no_interval_and_no_rates() -> None:
    first = summary([pod_health("engine-a", reading(0, query=50, hit=10), None)], 30)
    assert "hitRate" not in first and first["podsRead"] == 1 and first["cachedBlocks"] == 40
    restarted = pod_health("engine-a", reading(30, query=5, hit=0), reading(0, query=50, hit=10))
    assert restarted.previous is None and "hitRate" not in restarted.as_status()


def test_an_unread_pod_is_reported_and_left_out_of_the_aggregate() -> None:
    read = pod_health("engine-a", reading(30, query=200, hit=100), reading(0, query=100, hit=0))
    cache = summary([read, PodHealth("engine-b", error="GetCacheStats failed: UNAVAILABLE")], 30)
    assert (cache["podsRead"], cache["podsUnread"], cache["hitRate"]) == (1, 1, 1.0)
    assert cache["pods"][1] == {"name": "engine-b", "error": "GetCacheStats failed: UNAVAILABLE"}
    assert set(cache["pods"][0]) >= {"name", "hitRate", "kvUsage", "cachedBlocks", "evictionsPerMinute"}


def thrashing_interval(at: float) -> PodHealth:
    return pod_health("engine-a", reading(at + 30, query=2_000, hit=100, evicted=1_500, cold=400, used=90),
                      reading(at, query=1_000, hit=50, evicted=800, cold=150, used=90))


def test_thrashing_turns_on_after_it_stays_and_off_when_it_stops() -> None:
    streak = 0
    verdicts = []
    for at in (0, 30, 60):
        cache = summary([thrashing_interval(at)], 30)
        streak = streak + 1 if is_thrashing(cache, THRESHOLDS) else 0
        verdicts.append(thrashing_condition(cache, THRESHOLDS, streak))
    assert [c.status for c in verdicts] == [False, True, True]  # one interval is not "stays"
    on = verdicts[-1]
    assert on.type == CACHE_THRASHING and on.reason == "EvictedBeforeReuse"
    for text in ("evicted-miss share 74%", "KV usage 90%", "spec.kvCacheMemory", "prefixcache diagnose"):
        assert text in on.message
    calm = summary([pod_health("engine-a", reading(120, query=2_000, hit=1_500, cold=500, used=90),
                               reading(90, query=1_000, hit=700, cold=300, used=90))], 30)
    assert not is_thrashing(calm, THRESHOLDS)
    off = thrashing_condition(calm, THRESHOLDS, 0)
    assert (off.status, off.reason) == (False, "Healthy")


def test_evictions_while_usage_is_low_are_not_thrashing() -> None:
    """Blocks evicted while most of the pool sits idle are a reset or churn, not a budget too small."""
    low = pod_health("engine-a", reading(30, query=2_000, hit=100, evicted=1_500, cold=400, used=20),
                     reading(0, query=1_000, hit=50, evicted=800, cold=150, used=20))
    assert is_thrashing(summary([low], 30), THRESHOLDS) is False


def test_nothing_read_is_unknown_not_healthy() -> None:
    cache = summary([PodHealth("engine-a", error="GetCacheStats failed: UNAVAILABLE")], 30)
    condition = thrashing_condition(cache, THRESHOLDS, 0)
    assert (condition.status, condition.reason) == (None, "NotMeasured")
    assert "1 engine pods could not be read" in condition.message


def test_the_operator_hashes_its_admin_key_as_the_scheduler_does() -> None:
    assert key_hash("a" * 64) == hash_api_key("a" * 64)
