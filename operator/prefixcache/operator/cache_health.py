"""Cache health from two readings of each engine pod's `GetCacheStats`: pure arithmetic, no I/O.

The scheduler's counters run since its start, so a rate over them says little about now. Every figure
here is over the interval between two readings of the same scheduler (hit rate, evictions per minute,
the evicted-miss share); the block figures are as read. A pod read for the first time, or whose
counters went back (its scheduler restarted), has no interval yet: its rates are left out, not guessed.
A pod that could not be read is listed with the reason.

    hit rate           hit tokens / looked-up prompt tokens, over the interval
    evicted-miss share missed tokens whose blocks had been cached and were evicted to make room /
                       all missed tokens, over the interval: high means the KV budget is too small
                       for the working set (thrashing), low means misses are cold or partial blocks
    KV usage           blocks held by running requests / blocks in the pool, as read
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.operator.conditions import Condition

CACHE_THRASHING = "CacheThrashing"
EVICTED = "evicted"  # the missed-tokens reason of a block that was cached, then evicted


@dataclass(frozen=True, slots=True)
class Reading:
    """One pod's cache counters at one time (the fields of the Engine API's CacheStats the operator uses)."""

    at: float  # monotonic seconds
    query_tokens: int
    hit_tokens: int
    missed_tokens: int  # sum of missed_tokens_by_reason
    evicted_tokens: int  # missed_tokens_by_reason["evicted"]
    evictions: int
    num_blocks: int
    used_blocks: int
    cached_blocks: int

    @classmethod
    def from_stats(cls, at: float, stats: Any) -> Reading:
        missed = dict(stats.missed_tokens_by_reason)
        return cls(at=at, query_tokens=stats.query_tokens, hit_tokens=stats.hit_tokens,
                   missed_tokens=sum(missed.values()), evicted_tokens=missed.get(EVICTED, 0),
                   evictions=stats.evictions, num_blocks=stats.num_blocks, used_blocks=stats.used_blocks,
                   cached_blocks=stats.cached_blocks)

    def restarted_since(self, earlier: Reading) -> bool:
        return any(now < before for now, before in (
            (self.query_tokens, earlier.query_tokens), (self.hit_tokens, earlier.hit_tokens),
            (self.missed_tokens, earlier.missed_tokens), (self.evictions, earlier.evictions)))


@dataclass(frozen=True, slots=True)
class PodHealth:
    """One pod's figures; `error` set (and nothing else) when it could not be read."""

    name: str
    current: Reading | None = None
    previous: Reading | None = None  # the reading before, when the interval between them counts
    error: str | None = None

    def delta(self, attribute: str) -> int:
        assert self.current is not None and self.previous is not None
        return getattr(self.current, attribute) - getattr(self.previous, attribute)

    @property
    def has_interval(self) -> bool:
        return self.current is not None and self.previous is not None and self.current.at > self.previous.at

    def as_status(self) -> dict[str, Any]:
        if self.current is None:
            return {"name": self.name, "error": self.error or "not read"}
        entry: dict[str, Any] = {"name": self.name, "cachedBlocks": self.current.cached_blocks,
                                 "kvUsage": _ratio(self.current.used_blocks, self.current.num_blocks)}
        if self.has_interval:
            entry |= {k: v for k, v in _rates([self]).items() if v is not None}
        return entry


def pod_health(name: str, current: Reading, previous: Reading | None) -> PodHealth:
    """A pod's health from its new reading and the one before (None, or from before a restart: no interval)."""
    if previous is not None and current.restarted_since(previous):
        previous = None
    return PodHealth(name, current, previous)


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _rates(pods: Sequence[PodHealth]) -> dict[str, float | None]:
    """Hit rate, evictions per minute and evicted-miss share over the pods' intervals, summed."""
    timed = [p for p in pods if p.has_interval]
    if not timed:
        return {"hitRate": None, "evictionsPerMinute": None, "evictedMissShare": None}
    seconds = sum(p.current.at - p.previous.at for p in timed) / len(timed)  # type: ignore[union-attr]
    total = {attribute: sum(p.delta(attribute) for p in timed)
             for attribute in ("query_tokens", "hit_tokens", "missed_tokens", "evicted_tokens", "evictions")}
    return {"hitRate": _ratio(total["hit_tokens"], total["query_tokens"]),
            "evictionsPerMinute": round(total["evictions"] * 60 / seconds, 2),
            "evictedMissShare": _ratio(total["evicted_tokens"], total["missed_tokens"])}


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When the cache counts as thrashing (spec.cacheHealth)."""

    evicted_miss_share: float
    kv_usage: float
    intervals: int  # consecutive intervals above both thresholds before the condition turns True


def summary(pods: Sequence[PodHealth], interval_s: float) -> dict[str, Any]:
    """`.status.cache`: the aggregate over every pod read, and each pod's own figures."""
    read = [p for p in pods if p.current is not None]
    blocks = sum(p.current.num_blocks for p in read)  # type: ignore[union-attr]
    aggregate: dict[str, Any] = {
        "intervalSeconds": interval_s,
        "podsRead": len(read),
        "podsUnread": len(pods) - len(read),
        "cachedBlocks": sum(p.current.cached_blocks for p in read),  # type: ignore[union-attr]
        "kvUsage": _ratio(sum(p.current.used_blocks for p in read), blocks),  # type: ignore[union-attr]
        **_rates(read),
        "pods": [p.as_status() for p in sorted(pods, key=lambda p: p.name)],
    }
    return {key: value for key, value in aggregate.items() if value is not None}


def is_thrashing(cache: Mapping[str, Any], thresholds: Thresholds) -> bool | None:
    """Whether one interval's figures are above both thresholds; None when they cannot tell."""
    share, usage = cache.get("evictedMissShare"), cache.get("kvUsage")
    if cache.get("podsRead", 0) == 0 or usage is None or "hitRate" not in cache:
        return None
    return share is not None and share > thresholds.evicted_miss_share and usage >= thresholds.kv_usage


def thrashing_condition(cache: Mapping[str, Any], thresholds: Thresholds, streak: int) -> Condition:
    """CacheThrashing after `streak` consecutive thrashing intervals (this one included)."""
    verdict = is_thrashing(cache, thresholds)
    if verdict is None:
        unread, read = cache.get("podsUnread", 0), cache.get("podsRead", 0)
        why = (f"{unread} engine pods could not be read" if unread else
               "no interval measured yet" if read else "no ready engine pod to read")
        return Condition(CACHE_THRASHING, None, "NotMeasured", f"{why}; see status.cache.pods")
    numbers = (f"evicted-miss share {cache.get('evictedMissShare', 0):.0%} "
               f"(threshold {thresholds.evicted_miss_share:.0%}), KV usage {cache['kvUsage']:.0%} "
               f"(threshold {thresholds.kv_usage:.0%}), hit rate {cache.get('hitRate') or 0:.0%} "
               f"over the last {cache['intervalSeconds']:g} s")
    if verdict and streak >= thresholds.intervals:
        return Condition(CACHE_THRASHING, True, "EvictedBeforeReuse",
                         f"{numbers}: cached prefixes are evicted before they are reused. Raise spec.kvCacheMemory "
                         "(or add replicas), and run `prefixcache diagnose` against the Engine API to see how "
                         "much more memory would hit")
    return Condition(CACHE_THRASHING, False, "Healthy", numbers)
