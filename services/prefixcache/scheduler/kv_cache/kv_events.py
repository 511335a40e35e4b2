"""The KV events stream: which block hashes a scheduler holds, as a sequence of numbered batches.

A cache-aware router (or any other reader) rebuilds the set of cached hashes from three events:
`BlocksStored` (hashes in token order, with the hash of the block before the first one), `BlocksRemoved`
(hashes no block holds any more) and `CacheCleared` (everything is gone). Events are grouped into
batches, one per scheduler step that changed the cache; each batch has the next sequence number and
the epoch the cache is in. The epoch changes whenever the cache's content is dropped as a whole (at
start, on a prefix-cache reset, when the worker is lost), and a batch that opens an epoch holds just
`CacheCleared`. Epochs are random, so the epoch of a scheduler that restarted differs as well.

The log keeps the newest batches for subscribers to replay from a sequence number, up to
`max_buffered_entries` hashes (each event counts one more); older ones are dropped. Only hashes leave
the scheduler this way: never token ids, text or salts.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_BUFFERED_ENTRIES = 1 << 18


@dataclass(frozen=True, slots=True)
class BlocksStored:
    block_hashes: tuple[bytes, ...]  # in token order
    parent_hash: bytes | None  # the block before the first one; None for a prompt's first block
    block_size: int
    lora: bool  # a LoRA adapter's identity is part of these hashes
    multimodal: bool  # multimodal items are part of these hashes

    @property
    def token_count(self) -> int:
        return len(self.block_hashes) * self.block_size


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[bytes, ...]  # no block holds these any more


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every cached hash is gone (a new epoch begins)."""


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    seq: int  # 1, 2, 3, ... within this scheduler process
    epoch: int  # the cache's epoch once this batch is applied
    events: tuple[KvEvent, ...]
    at_ns: int  # wall clock (time.time_ns) when the batch was published


def _size(event: KvEvent) -> int:
    return 1 + len(getattr(event, "block_hashes", ()))


def new_epoch() -> int:
    return secrets.randbits(63) + 1  # never 0, which a proto3 reader cannot tell from unset


class KvEventLog:
    """Collects events as the cache changes, publishes them as batches, and keeps the newest ones.

    Not thread-safe: the scheduler's event loop owns it. Listeners are called after each publication.
    """

    def __init__(self, max_buffered_entries: int = DEFAULT_MAX_BUFFERED_ENTRIES) -> None:
        if max_buffered_entries < 1:
            raise ValueError(f"max_buffered_entries must be >= 1, got {max_buffered_entries}")
        self.max_buffered_entries = max_buffered_entries
        self._pending: list[KvEvent] = []
        self._batches: dict[int, KvEventBatch] = {}  # seq -> batch, oldest first, contiguous
        self._sizes: dict[int, int] = {}
        self._buffered = 0
        self.oldest_seq = 1  # of the buffered batches (next_seq when none is)
        self.next_seq = 1
        self.epoch = new_epoch()
        self._listeners: list[Callable[[], None]] = []
        self._empty = True  # nothing stored since the last clear: clearing again changes nothing
        self._publish([CacheCleared()])  # a reader from the start learns the first epoch

    # -- what the cache reports ------------------------------------------------------------------

    def stored(self, block_hashes: Sequence[bytes], parent_hash: bytes | None, block_size: int, *,
               lora: bool = False, multimodal: bool = False) -> None:
        if block_hashes:
            self._pending.append(BlocksStored(tuple(block_hashes), parent_hash, block_size, lora, multimodal))
            self._empty = False

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        if block_hashes:
            self._pending.append(BlocksRemoved(tuple(block_hashes)))

    def cleared(self) -> None:
        """The cache was emptied: publish what is pending, then a new epoch's `CacheCleared`."""
        if self._empty:  # nothing was announced since the last clear: no reader holds a hash
            return
        self.publish()
        self.epoch = new_epoch()
        self._publish([CacheCleared()])
        self._empty = True

    def publish(self) -> None:
        """Seal the pending events into the next batch (nothing happens when none is pending)."""
        if self._pending:
            events, self._pending = self._pending, []
            self._publish(events)

    # -- what subscribers read ------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The newest published batch's sequence number."""
        return self.next_seq - 1

    def get(self, seq: int) -> KvEventBatch | None:
        """Batch `seq` if it is still buffered."""
        return self._batches.get(seq)

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.remove(listener)

    def _publish(self, events: list[KvEvent]) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self._batches[seq] = KvEventBatch(seq, self.epoch, tuple(events), time.time_ns())
        size = self._sizes[seq] = sum(map(_size, events))
        self._buffered += size
        while self._buffered > self.max_buffered_entries and self.oldest_seq < seq:
            del self._batches[self.oldest_seq]
            self._buffered -= self._sizes.pop(self.oldest_seq)
            self.oldest_seq += 1
        for listener in list(self._listeners):
            listener()
