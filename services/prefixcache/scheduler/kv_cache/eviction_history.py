"""Evictions: the blocks one allocation took (`EvictionBatch`), and the pool's bounded memory of them.

A miss on an evicted block can then name its cause: the request whose allocation took the block
(and that request's span context, so a trace can link to it), when that happened, and how long the
block had lived, stored by which request. The history keeps at least the `capacity` most recently
evicted hashes and at most twice as many plus one allocation's (two generations, so that remembering
an allocation's evictions is one bulk dict update, each hash pointing at its batch); older ones are
forgotten and later misses on them read as "cold". A batch stays in memory while the history points
at one of its hashes, so the batches it keeps hold as many entries as it does, at most.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Literal, NamedTuple


@dataclass(frozen=True, slots=True)
class RequestRef:
    """A request as the cache remembers it: its id and, when it is traced, its span context.

    The span context is opaque here (the cache imports no tracing); the Engine API links spans with it.
    """

    request_id: str
    trace_context: object | None = None


class EvictionEvent(NamedTuple):
    """A cached block lost its hash: its KV can no longer be reused."""

    block_hash: bytes
    block_id: int
    evicting_request_id: str | None  # whose allocation took the block; None for a reset
    storing_request_id: str  # the request whose tokens filled the block
    reason: Literal["allocation", "reset"] = "allocation"


@dataclass(frozen=True, slots=True)
class EvictionBatch:
    """The blocks one allocation (or a reset) evicted, in eviction order.

    Kept as parallel lists and turned into `EvictionEvent`s only when iterated: an allocation at a
    0% hit rate can evict thousands of blocks, and most batches are only counted (an event object
    per block cost about a fifth of a 32k-token request's cache work).
    """

    evicting: RequestRef | None  # whose allocation took the blocks; None for a reset
    reason: Literal["allocation", "reset"]
    block_ids: list[int]
    block_hashes: list[bytes]
    storers: list[RequestRef]  # per block, the request whose tokens filled it
    stored_at_ns: list[int]  # per block, when it was filled (wall clock, time.time_ns)
    evicted_at_ns: int  # wall clock when the blocks lost their hashes

    def __len__(self) -> int:
        return len(self.block_ids)

    def __iter__(self) -> Iterator[EvictionEvent]:
        evicting_request_id = self.evicting_request_id
        for block_hash, block_id, storer in zip(self.block_hashes, self.block_ids, self.storers):
            yield EvictionEvent(block_hash, block_id, evicting_request_id, storer.request_id, self.reason)

    @property
    def evicting_request_id(self) -> str | None:
        return None if self.evicting is None else self.evicting.request_id

    @property
    def storing_request_ids(self) -> list[str]:
        return [storer.request_id for storer in self.storers]

    @property
    def oldest_age_ns(self) -> int:
        """How long the longest-lived of these blocks had held its hash (0 for an empty batch)."""
        return self.evicted_at_ns - min(self.stored_at_ns, default=self.evicted_at_ns)

    def last(self, count: int) -> EvictionBatch:
        """The batch's last `count` evictions."""
        start = len(self.block_ids) - count
        return EvictionBatch(self.evicting, self.reason, self.block_ids[start:], self.block_hashes[start:],
                             self.storers[start:], self.stored_at_ns[start:], self.evicted_at_ns)


class EvictionRecord(NamedTuple):
    """One evicted block: who took it and when, and who had stored it when."""

    evicted_by: RequestRef
    evicted_at_ns: int  # wall clock (time.time_ns)
    stored_by: RequestRef
    stored_at_ns: int

    @property
    def age_ns(self) -> int:
        """How long the block had held this hash when it was evicted."""
        return self.evicted_at_ns - self.stored_at_ns


class EvictionHistory:
    """The last `capacity` evicted hashes or more (see the module's docstring), each with its `EvictionRecord`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._current: dict[bytes, EvictionBatch] = {}
        self._previous: dict[bytes, EvictionBatch] = {}

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._current or block_hash in self._previous

    def add(self, batch: EvictionBatch) -> None:
        """Remember one allocation's evictions."""
        self._current.update(zip(batch.block_hashes, repeat(batch)))
        if len(self._current) >= self.capacity:
            self._previous, self._current = self._current, {}

    def get(self, block_hash: bytes) -> EvictionRecord | None:
        """The newest record of `block_hash`, if it is remembered."""
        batch = self._current.get(block_hash)
        if batch is None:
            batch = self._previous.get(block_hash)
            if batch is None:
                return None
        index = batch.block_hashes.index(block_hash)
        return EvictionRecord(batch.evicting, batch.evicted_at_ns, batch.storers[index], batch.stored_at_ns[index])

    def clear(self) -> None:
        self._current.clear()
        self._previous.clear()
