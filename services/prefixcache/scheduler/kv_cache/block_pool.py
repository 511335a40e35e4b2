"""The block pool: reference counts, block hashes, the hash→block map and eviction."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Literal

from prefixcache.scheduler.kv_cache.eviction_history import EvictionBatch, EvictionHistory, EvictionRecord, RequestRef
from prefixcache.scheduler.kv_cache.free_queue import FreeBlockQueue
from prefixcache.scheduler.kv_cache.kv_events import KvEventLog


class BlockPool:
    """N blocks, ids 0..N-1, with reference counts and an optional content hash each.

    - `ref_counts[b]` is the number of requests using block b; b is in `free_queue` iff it is 0.
    - `block_hashes[b]` is set once b is full and cached, and cleared when b is evicted, which
      happens only when b is popped from the free queue for a new allocation (or on reset).
    - `cached` maps a hash to one block holding it. Two requests computing the same block at the
      same time produce two blocks with one hash; block tables are append-only, so neither is
      merged away: the later ones wait in `_duplicates` and the oldest takes over when the block
      in `cached` is evicted.
    - `history` remembers who evicted each recently evicted hash, so a miss can be explained as
      "evicted" (and by whom) rather than "cold".
    - `events`, when given, hears of every hash no block holds any more (the KV events stream).
    """

    def __init__(self, num_blocks: int, evicted_history: int, max_pending_events: int,
                 events: KvEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        # Per block, the request that cached it and when; meaningful only while the block holds a hash.
        self.stored_by: list[RequestRef | None] = [None] * num_blocks
        self.stored_at_ns: list[int] = [0] * num_blocks
        self.free_queue = FreeBlockQueue(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> a block holding it
        self._duplicates: dict[bytes, list[int]] = {}  # hash -> further blocks holding it
        self.num_cached_blocks = 0
        self.num_idle_cached_blocks = 0  # cached and held by no request (in the free queue)
        self.history = EvictionHistory(max(evicted_history, 1))
        self.events = events
        self._pending_batches: deque[EvictionBatch] = deque()
        self._num_pending_events = 0
        self._max_pending_events = max_pending_events
        self.events_dropped = 0
        self.num_evictions = 0  # blocks evicted to make room (a reset's are not counted)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_with_hash(self, block_hash: bytes) -> list[int]:
        """Every block currently holding `block_hash` (normally zero or one)."""
        first = self.cached.get(block_hash)
        if first is None:
            return []
        return [first, *self._duplicates.get(block_hash, ())]

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks, unlinking free ones from the free queue."""
        ref_counts = self.ref_counts
        idle = [b for b in block_ids if ref_counts[b] == 0]
        self.free_queue.remove_n(idle)
        self.num_idle_cached_blocks -= len(idle)  # a hit block holds a hash
        for block_id in block_ids:
            ref_counts[block_id] += 1

    def allocate(self, count: int, requester: RequestRef) -> list[int]:
        """Pop `count` blocks from the head of the free queue, evicting the hashes they held."""
        block_ids = self.free_queue.popleft_n(count)
        ref_counts, block_hashes = self.ref_counts, self.block_hashes
        for block_id in block_ids:
            ref_counts[block_id] = 1
        evicted = [b for b in block_ids if block_hashes[b] is not None]
        if evicted:
            self._evict(evicted, requester, "allocation")
        return block_ids

    def _evict(self, block_ids: list[int], requester: RequestRef | None,
               reason: Literal["allocation", "reset"]) -> None:
        """Clear the hashes of `block_ids` (free blocks), recording them as one pending batch, in order."""
        block_hashes, cached = self.block_hashes, self.cached
        hashes = list(map(block_hashes.__getitem__, block_ids))
        for block_id in block_ids:
            block_hashes[block_id] = None
        if self._duplicates and not self._duplicates.keys().isdisjoint(hashes):
            lost = [h for h, b in zip(hashes, block_ids) if self._drop_copy(h, b)]
        else:  # the common case, in bulk: every hash had this one block
            deque(map(cached.__delitem__, hashes), maxlen=0)
            lost = hashes
        batch = EvictionBatch(requester, reason, block_ids, hashes, list(map(self.stored_by.__getitem__, block_ids)),
                              list(map(self.stored_at_ns.__getitem__, block_ids)), time.time_ns())
        if requester is not None:  # a reset is no eviction pressure: what it drops misses as "cold"
            self.history.add(batch)
            self.num_evictions += len(block_ids)
            if self.events is not None:
                self.events.removed(lost)
        self.num_cached_blocks -= len(block_ids)
        self.num_idle_cached_blocks -= len(block_ids)
        self._add_pending(batch)

    def _add_pending(self, batch: EvictionBatch) -> None:
        """Queue a batch for `take_events`, dropping the oldest events beyond the bound."""
        self._pending_batches.append(batch)
        self._num_pending_events += len(batch)
        excess = self._num_pending_events - self._max_pending_events
        while excess > 0:
            oldest = self._pending_batches.popleft()
            if len(oldest) > excess:
                self._pending_batches.appendleft(oldest.last(len(oldest) - excess))
            dropped = min(len(oldest), excess)
            self._num_pending_events -= dropped
            self.events_dropped += dropped
            excess -= dropped

    def _drop_copy(self, block_hash: bytes, block_id: int) -> bool:
        """Unmap one block holding `block_hash`; True if no other block holds it any more."""
        duplicates = self._duplicates.get(block_hash)
        if duplicates is None:
            del self.cached[block_hash]
            return True
        if self.cached[block_hash] == block_id:
            self.cached[block_hash] = duplicates.pop(0)
        else:
            duplicates.remove(block_id)
        if not duplicates:
            del self._duplicates[block_hash]
        return False

    def eviction_of(self, block_hash: bytes) -> EvictionRecord | None:
        """Who evicted `block_hash` and when, if it was cached and evicted recently (see `history`)."""
        return self.history.get(block_hash)

    def cache(self, block_ids: Sequence[int], block_hashes: Sequence[bytes], storer: RequestRef) -> None:
        """Record that full blocks (held by `storer`) hold the KV of `block_hashes`; they become reusable."""
        hashes, stored_by, stored_at, cached = self.block_hashes, self.stored_by, self.stored_at_ns, self.cached
        now = time.time_ns()
        for block_id, block_hash in zip(block_ids, block_hashes):
            hashes[block_id] = block_hash
            stored_by[block_id] = storer
            stored_at[block_id] = now
        if cached.keys().isdisjoint(block_hashes):
            cached.update(zip(block_hashes, block_ids))
        else:  # another request cached some of these hashes first: keep both blocks
            for block_id, block_hash in zip(block_ids, block_hashes):
                if cached.setdefault(block_hash, block_id) != block_id:
                    self._duplicates.setdefault(block_hash, []).append(block_id)
        self.num_cached_blocks += len(block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, releasing them in the order given.

        Released blocks that hold a hash join the tail (evicted last: LRU); blocks without one
        are pushed onto the head (reused first: their content is worthless).
        """
        ref_counts, block_hashes = self.ref_counts, self.block_hashes
        hashed: list[int] = []
        unhashed: list[int] = []
        for block_id in block_ids:
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count == 0:
                (unhashed if block_hashes[block_id] is None else hashed).append(block_id)
        self.free_queue.append_n(hashed)
        self.free_queue.push_front_n(unhashed)
        self.num_idle_cached_blocks += len(hashed)

    def reset(self) -> bool:
        """Forget every cached hash, and which were evicted (later misses are "cold"); refuses
        (False) while any block is in use. The caller tells `events` (a new epoch)."""
        if len(self.free_queue) != self.num_blocks:
            return False
        self._evict([b for b, h in enumerate(self.block_hashes) if h is not None], None, "reset")
        self.history.clear()  # nothing evicted before is in the cache either: cold again
        return True

    def take_events(self) -> list[EvictionBatch]:
        """The pending eviction batches, oldest first; none are pending afterwards."""
        batches = list(self._pending_batches)
        self._pending_batches.clear()
        self._num_pending_events = 0
        return batches
