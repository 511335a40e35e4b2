"""Every request's first lookup, counted and kept for a while: what `prefixcache diagnose` reads.

Counters run since the scheduler started (and outlive a worker loss, like the other counters): first
lookups, those that stopped at an evicted block, lookups a larger cache would have served, and the
prompt tokens not served by reason. The newest `window` lookups are also kept one by one, each with
what an LRU cache of each size in `WHAT_IF_FACTORS` times the real one would have served (from the
cache's stack distances), about 300 bytes each.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Cache sizes, relative to the real one, for which each lookup's hits are worked out.
WHAT_IF_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)
# Why prompt tokens were not served: the lookup's miss reason for the blocks after the hit, "capped"
# for a full match's last block (recomputed because the last token must run) and "partial_tail" for
# the tokens after the last full block (never cached).
MISSED_TOKEN_REASONS = ("cold", "evicted", "capped", "partial_tail")
DEFAULT_WINDOW = 10_000


@dataclass(frozen=True, slots=True)
class LookupRecord:
    queried_tokens: int
    hit_tokens: int
    capped_tokens: int
    partial_tail_tokens: int
    miss_reason: str
    what_if_hit_tokens: tuple[int, ...]  # per WHAT_IF_FACTORS
    first_block_hash: bytes | None = None  # set for evicted misses: which prefix came back too late
    evicted_age_ns: int | None = None  # for evicted misses: how long the missing block had lived

    @property
    def missed_tokens(self) -> dict[str, int]:
        """The tokens not served, by reason (zeros left out)."""
        walked = self.queried_tokens - self.hit_tokens - self.capped_tokens - self.partial_tail_tokens
        missed = {self.miss_reason: walked, "capped": self.capped_tokens, "partial_tail": self.partial_tail_tokens}
        return {reason: tokens for reason, tokens in missed.items() if tokens}


class LookupLog:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.records: deque[LookupRecord] = deque(maxlen=window)
        self.lookups = 0
        self.evicted_lookups = 0
        self.ghost_hits = 0  # lookups the largest what-if cache would have served more of
        self.missed_tokens: dict[str, int] = dict.fromkeys(MISSED_TOKEN_REASONS, 0)

    def record(self, record: LookupRecord) -> None:
        self.records.append(record)
        self.lookups += 1
        self.evicted_lookups += record.miss_reason == "evicted"
        self.ghost_hits += record.what_if_hit_tokens[-1] > record.hit_tokens
        for reason, tokens in record.missed_tokens.items():
            self.missed_tokens[reason] = self.missed_tokens.get(reason, 0) + tokens

    def last(self, count: int) -> list[LookupRecord]:
        """The newest `count` records (all of them when fewer are kept), oldest first."""
        records = self.records
        return list(records)[max(len(records) - count, 0):]
