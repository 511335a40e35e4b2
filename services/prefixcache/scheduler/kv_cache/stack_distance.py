"""Exact LRU stack distances of block hashes: how much larger a cache would have kept a block.

The pool evicts cached blocks in the order they were released (the free queue's order), so it is an
LRU cache over the sequence of releases. Mattson's stack algorithm gives each hash its stack
distance: how many distinct hashes were released after its own last release. An LRU cache of C
blocks holds a hash exactly when its distance is below C, for every C at once, so one pass over the
lookups tells what any cache size would have hit.

The stack is kept at least `depth` hashes deep (the part below the real cache's size is the ghost
list of evicted hashes); the oldest release batches go as a whole once the rest holds `depth`
hashes, so it holds at most `depth` plus one batch. A hash no longer on it counts as never seen.
Releases come in batches (one request's blocks at a time), so the stack is a sequence of release
batches with a Fenwick tree over their live counts: a release costs O(1) per block, in bulk, and
O(log batches) per batch it moves hashes out of; a lookup costs O(log batches) plus one pass over
each batch it finds hashes in. Memory stays O(depth): batches are renumbered, and their stale
entries dropped, once those entries outnumber the live hashes.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from functools import partial
from itertools import accumulate, compress, repeat
from operator import eq, is_not, rshift

_INDEX_BITS = 32
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_MIN_SLOTS = 1024
_is_position = partial(is_not, None)  # of a hash on the stack (0 is one), in C


class _Fenwick:
    """Prefix sums over slots 0..size-1."""

    def __init__(self, counts: Sequence[int], size: int) -> None:
        tree = [0, *counts, *[0] * (size - len(counts))]
        for index in range(1, size + 1):  # each node passes its total on to its parent, in order
            parent = index + (index & -index)
            if parent <= size:
                tree[parent] += tree[index]
        self._tree = tree
        self.size = size

    def add(self, slot: int, delta: int) -> None:
        tree, index = self._tree, slot + 1
        while index <= self.size:
            tree[index] += delta
            index += index & -index

    def prefix(self, slot: int) -> int:
        """Sum over slots 0..slot."""
        tree, index, total = self._tree, slot + 1, 0
        while index:
            total += tree[index]
            index -= index & -index
        return total


class StackDistances:
    """LRU stack distances over release batches, at least `depth` hashes deep.

    A batch keeps every hash it released; an entry is live while `_where` still points at it (a later
    release of the same hash moves it to a newer batch). So releasing, trimming and renumbering are bulk
    dict and list operations, and a lookup works out which entries of a batch are live when it needs to.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.clear()

    def clear(self) -> None:
        self._where: dict[bytes, int] = {}  # hash -> slot << 32 | index in that slot's batch
        self._batches: dict[int, list[bytes]] = {}  # slot -> hashes released, least recent first
        self._live: dict[int, int] = {}  # slot -> entries of its batch still live
        self._tree = _Fenwick((), _MIN_SLOTS)
        self._next_slot = 0
        self._size = 0  # live entries
        self._stale = 0  # entries no longer live, in the batches kept

    def __len__(self) -> int:
        return self._size

    def release(self, block_hashes: Sequence[bytes]) -> None:
        """`block_hashes` (distinct) were released, in this order: the last one is now the most recent."""
        if not block_hashes:
            return
        if self._next_slot >= self._tree.size or self._stale > max(self._size, _MIN_SLOTS):
            self._renumber()
        slot = self._next_slot
        self._next_slot += 1
        batch = list(block_hashes)
        where = self._where
        moved = Counter(map(rshift, filter(_is_position, map(where.get, batch)), repeat(_INDEX_BITS)))  # by old slot
        base = slot << _INDEX_BITS
        where.update(zip(batch, range(base, base + len(batch))))
        self._batches[slot] = batch
        self._live[slot] = len(batch)
        self._size += len(batch)
        self._tree.add(slot, len(batch))
        for old_slot, count in moved.items():
            self._remove_from(old_slot, count)
        self._trim()

    def reach(self, block_hashes: Sequence[bytes], limit: int) -> list[int]:
        """For each leading hash, the largest stack distance among it and the hashes before it; the
        list stops before the first hash not on the stack and after the first reach of `limit` or more.

        An LRU cache of C blocks would have served exactly the first `bisect_left(reach, C)` hashes.
        """
        where, tree = self._where, self._tree
        reaches: list[int] = []
        farthest = -1
        current_slot = -1
        newer = 0
        live_from: list[int] = []
        last = 0
        for block_hash in block_hashes:
            position = where.get(block_hash)
            if position is None:
                break
            slot, index = position >> _INDEX_BITS, position & _INDEX_MASK
            if slot != current_slot:
                current_slot = slot
                newer = self._size - tree.prefix(slot)
                live = self._live_entries(slot)
                live_from = list(accumulate(reversed(live)))  # [k]: live entries among the batch's last k + 1
                last = len(live) - 1
            distance = newer + live_from[last - index] - 1
            farthest = max(farthest, distance)
            reaches.append(farthest)
            if farthest >= limit:
                break
        return reaches

    def _live_entries(self, slot: int) -> list[bool]:
        """Per entry of the batch in `slot`, whether it is live."""
        batch, base = self._batches[slot], slot << _INDEX_BITS
        return list(map(eq, map(self._where.get, batch), range(base, base + len(batch))))

    def _remove_from(self, slot: int, count: int) -> None:
        """`count` entries of the batch in `slot` are no longer live."""
        self._tree.add(slot, -count)
        self._size -= count
        self._stale += count
        live = self._live[slot] - count
        if live:
            self._live[slot] = live
        else:  # an emptied batch goes, and its stale entries with it
            del self._live[slot]
            self._stale -= len(self._batches.pop(slot))

    def _trim(self) -> None:
        """Forget the oldest release batches while the newer ones hold `depth` hashes or more."""
        live = self._live
        while self._size - live[oldest := next(iter(live))] >= self.depth:
            forgotten = compress(self._batches[oldest], self._live_entries(oldest))
            deque(map(self._where.__delitem__, forgotten), maxlen=0)
            self._remove_from(oldest, live[oldest])

    def _renumber(self) -> None:
        """Give the live batches slots 0, 1, ... without their stale entries, and a tree with room."""
        kept = [list(compress(self._batches[slot], self._live_entries(slot))) for slot in self._live]
        where = self._where
        for slot, batch in enumerate(kept):
            base = slot << _INDEX_BITS
            where.update(zip(batch, range(base, base + len(batch))))
        self._batches = dict(enumerate(kept))
        self._live = {slot: len(batch) for slot, batch in enumerate(kept)}
        self._next_slot = len(kept)
        self._tree = _Fenwick(list(self._live.values()),
                              self._next_slot + max(self._next_slot, self._size // 16, _MIN_SLOTS))
        self._stale = 0

