"""Who evicted a block, and when: the pool's bounded memory of recent evictions.

A miss on an evicted block can then name its cause: the request whose allocation took the block
(and that request's span context, so a trace can link to it), when that happened, and how long the
block had lived, stored by which request. The history keeps at least the `capacity` most recently
evicted hashes and at most twice as many plus one allocation's (two generations, so that remembering
an allocation's evictions is one bulk dict update); older ones are forgotten and later misses on them
read as "cold".
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class RequestRef:
    """A request as the cache remembers it: its id and, when it is traced, its span context.

    The span context is opaque here (the cache imports no tracing); the Engine API links spans with it.
    """

    request_id: str
    trace_context: object | None = None


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


Record = tuple[RequestRef, int, RequestRef, int]  # an EvictionRecord's fields, as zip builds them in C


class EvictionHistory:
    """The last `capacity` evicted hashes or more (see the module's docstring), each with its `EvictionRecord`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._current: dict[bytes, Record] = {}
        self._previous: dict[bytes, Record] = {}

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._current or block_hash in self._previous

    def add(self, block_hashes: Sequence[bytes], evicted_by: RequestRef, evicted_at_ns: int,
            stored_by: Sequence[RequestRef], stored_at_ns: Sequence[int]) -> None:
        """Remember one allocation's evictions (parallel sequences, one entry per block)."""
        self._current.update(zip(block_hashes, zip(repeat(evicted_by), repeat(evicted_at_ns), stored_by,
                                                   stored_at_ns)))
        if len(self._current) >= self.capacity:
            self._previous, self._current = self._current, {}

    def get(self, block_hash: bytes) -> EvictionRecord | None:
        """The newest record of `block_hash`, if it is remembered."""
        record = self._current.get(block_hash) or self._previous.get(block_hash)
        return None if record is None else EvictionRecord(*record)

    def clear(self) -> None:
        self._current.clear()
        self._previous.clear()
