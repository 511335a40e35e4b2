"""The KV cache manager: automatic prefix caching over a pool of fixed-size KV blocks.

One request's life, as the scheduler drives it:

    blocks, account = manager.get_computed_blocks(request)      # pure lookup
    new = manager.allocate_slots(request, n, blocks)            # None: no room, preempt someone
    request.num_computed_tokens += len(blocks) * block_size     # (the scheduler's job)
    ... each step: manager.allocate_slots(request, tokens_this_step)
    manager.free(request.request_id)                            # finished, aborted or preempted

Blocks layout of a request while it runs (allocate_slots):

    | hit blocks (shared, read-only) | own full blocks (cached as they fill) | partial | free slots |
    0                           hits*bs                                  num_tokens         capacity
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from prefixcache.block_identity.hash_memo import BlockHashMemo
from prefixcache.block_identity.hashing import NO_EXTRAS, BlockExtras, BlockHash, BlockHasher
from prefixcache.scheduler.kv_cache.block_pool import BlockPool
from prefixcache.scheduler.kv_cache.eviction_history import EvictionBatch, EvictionRecord, RequestRef
from prefixcache.scheduler.kv_cache.kv_events import KvEventLog
from prefixcache.scheduler.kv_cache.lookup_log import WHAT_IF_FACTORS, LookupRecord
from prefixcache.scheduler.kv_cache.stack_distance import StackDistances

# Blocks per generation of the hash memo (two generations of at most this many entries, about
# 200 bytes each at block size 16): a million tokens of popular prefixes recalled without hashing.
MAX_HASH_MEMO_BLOCKS = 1 << 16

MissReason = Literal["cold", "evicted", "full_hit", "disabled", "no_full_block"]


@dataclass
class KVRequest:
    """What the manager needs to know about a request; the scheduler owns one per request.

    `token_ids` (prompt, then generated tokens) may only grow. `block_hashes` holds the hashes of
    its full blocks and is extended by the manager as tokens arrive, never recomputed.
    """

    request_id: str
    token_ids: list[int]
    extras: BlockExtras = NO_EXTRAS
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Set by the manager once its first allocation is in the query and hit counters, so the
    # recompute after a preemption (free, then allocate again) is not counted twice.
    counted: bool = False
    trace_context: object | None = None  # its span's, when traced: evictions and stores link to it
    ref: RequestRef = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ref = RequestRef(self.request_id, self.trace_context)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class CacheAccount:
    """Why a lookup hit what it hit. All counts are for one lookup of one request.

    miss_reason: `full_hit` every full block was cached; `cold` the first missing block was never
    cached (or was evicted too long ago to remember, or dropped by a prefix-cache reset);
    `evicted` it was cached and recently evicted to make room; `no_full_block` the prompt is shorter than one block; `disabled` caching is off.
    """

    queried_tokens: int  # the request's tokens
    hit_tokens: int  # tokens whose KV is reused
    capped_tokens: int  # cached, but recomputed because the last token must run (whole last block)
    partial_tail_tokens: int  # tokens after the last full block: never cached
    miss_reason: MissReason
    hit_blocks: int
    queried_blocks: int  # full blocks looked up
    # The first full block the lookup did not find (none for a full hit), and, for an "evicted"
    # miss, who evicted it and when. Not part of the account's equality: they explain it.
    first_missing_block: bytes | None = field(default=None, compare=False)
    eviction: EvictionRecord | None = field(default=None, compare=False)


@dataclass(frozen=True)
class CacheStats:
    """Aggregate counters. Queries and hits are in tokens, counted at a request's first allocation
    only (not again when it is recomputed after a preemption) and not at all with caching off."""

    num_blocks: int
    free_blocks: int  # includes cached blocks that no request uses (eviction candidates)
    used_blocks: int  # referenced by at least one request
    cached_blocks: int  # holding a reusable hash, used or free
    queries: int
    hits: int
    evictions: int  # cached blocks evicted to make room (not those a reset dropped)
    events_dropped: int  # eviction events lost because nobody drained them
    idle_cached_blocks: int = 0  # cached blocks no request holds: the next to be evicted, oldest first


class KVCacheManager:
    """Block allocation with vLLM-v1-style automatic prefix caching, explained per request.

    Rules: lookups return the longest run of leading cached blocks, capped at num_tokens - 1 and
    block-aligned; allocation pops free blocks from the head of the free queue and only then
    evicts the hash they held; blocks in use are never evicted; a finished request releases its
    blocks in reverse order, cached ones to the tail of the free queue and the rest to the head.
    Blocks are cached as soon as the tokens that fill them are scheduled, decode included.

    Args:
        num_blocks: blocks in the pool, ids 0..num_blocks-1 (all usable: there is no null block).
        hasher: names blocks; its block size is the manager's.
        enable_caching: False hashes nothing and reuses nothing.
        evicted_history: how many evicted hashes are remembered, with who evicted them and when,
            to tell an "evicted" miss from a "cold" one and explain it (default: 4 x num_blocks,
            at least 1024).
        max_pending_events: eviction events kept until `drain_events`; older ones are dropped
            and counted in `CacheStats.events_dropped`.
        events: the KV events stream to report stored, removed and cleared hashes to.

    Released blocks also feed an LRU stack of block hashes, `max(WHAT_IF_FACTORS)` x num_blocks
    deep (`stack_distance.py`), from which `lookup_record` tells what larger or smaller caches would
    have hit.

    Not thread-safe: one scheduler loop owns it.
    """

    def __init__(self, num_blocks: int, hasher: BlockHasher, enable_caching: bool = True,
                 evicted_history: int | None = None, max_pending_events: int = 65536,
                 events: KvEventLog | None = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(hasher, BlockHasher):
            raise ValueError(f"hasher must be a BlockHasher, got {type(hasher).__name__}")
        if evicted_history is None:
            evicted_history = max(4 * num_blocks, 1024)
        if evicted_history < 0 or max_pending_events < 1:
            raise ValueError("evicted_history must be >= 0 and max_pending_events >= 1")
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.enable_caching = enable_caching
        self._pool = BlockPool(num_blocks, evicted_history, max_pending_events, events)
        self._events = events
        self._what_if_blocks = [round(factor * num_blocks) for factor in WHAT_IF_FACTORS]
        self._stack = StackDistances(math.ceil(max(WHAT_IF_FACTORS) * num_blocks))
        # Recalling a hash is cheaper than computing it with sha256, not with xxhash (hash_memo.py).
        self._hash_memo = (BlockHashMemo(self.block_size, capacity=min(num_blocks, MAX_HASH_MEMO_BLOCKS))
                           if enable_caching and hasher.algo == "sha256" else None)
        self._blocks: dict[str, list[int]] = {}  # request id -> its blocks, in token order
        self._num_cached: dict[str, int] = {}  # request id -> how many of its leading blocks are cached
        self._queries = 0
        self._hits = 0

    # -- lookup ------------------------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], CacheAccount]:
        """The longest cached prefix of `request` (block ids) and the account explaining it.

        No reference is taken and no block changes, so pass the blocks to `allocate_slots` before
        anything else allocates. Hashes of the request's new full blocks are computed (or recalled)
        here, and those of the cached prefix it found are remembered for later requests.
        """
        block_size = self.block_size
        num_tokens = len(request.token_ids)
        num_full = num_tokens // block_size
        tail = num_tokens - num_full * block_size
        if not self.enable_caching:
            return [], CacheAccount(num_tokens, 0, 0, tail, "disabled", 0, num_full)
        if num_full == 0:
            return [], CacheAccount(num_tokens, 0, 0, tail, "no_full_block", 0, 0)
        # Hashes of a popular prefix come from the memo, and a request's first lookup remembers
        # there the blocks it found cached (later lookups, while it waits for room or after a
        # preemption, find what its first one did, or its own blocks).
        memo = self._hash_memo
        num_remembered = num_full
        num_known = len(request.block_hashes)
        if memo is not None and not num_known:
            request.block_hashes.extend(memo.recall(request.token_ids, request.extras))
            num_remembered = len(request.block_hashes)
        try:
            hashes = self._update_hashes(request)
        except ValueError:  # bad token ids: the request leaves as it came, recalled hashes included
            del request.block_hashes[num_known:]
            raise
        cached = self._pool.cached
        found = list(map(cached.get, hashes)) if hashes[0] in cached else [None]
        try:
            num_found = found.index(None)
        except ValueError:
            num_found = len(found)
        # The last token must run to produce logits, so at most (num_tokens - 1) tokens hit.
        num_hit = min(num_found, (num_tokens - 1) // block_size)
        if num_remembered < num_found:
            memo.remember(request.token_ids, request.extras, hashes, num_remembered, num_found)
        missing = hashes[num_found] if num_found < num_full else None
        eviction = self._pool.eviction_of(missing) if missing is not None else None
        reason: MissReason = "full_hit" if missing is None else "evicted" if eviction is not None else "cold"
        account = CacheAccount(num_tokens, num_hit * block_size, (num_found - num_hit) * block_size, tail,
                               reason, num_hit, num_full, missing, eviction)
        return found[:num_hit], account

    def lookup_record(self, request: KVRequest, account: CacheAccount) -> LookupRecord:
        """A request's first lookup as `LookupLog` keeps it, with what an LRU cache of each size in
        `WHAT_IF_FACTORS` would have served (from the stack distances its blocks have now)."""
        block_size = self.block_size
        hashes = request.block_hashes[: account.queried_blocks]
        reach = self._stack.reach(hashes, self._what_if_blocks[-1])
        most = (account.queried_tokens - 1) // block_size
        what_if = tuple(min(bisect_left(reach, blocks), most) * block_size for blocks in self._what_if_blocks)
        evicted = account.eviction
        return LookupRecord(account.queried_tokens, account.hit_tokens, account.capped_tokens,
                            account.partial_tail_tokens, account.miss_reason, what_if,
                            first_block_hash=hashes[0] if evicted is not None else None,
                            evicted_age_ns=evicted.age_ns if evicted is not None else None)

    def _update_hashes(self, request: KVRequest) -> list[BlockHash]:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        hashes = request.block_hashes
        if len(request.token_ids) // self.block_size > len(hashes):
            hashes.extend(self.hasher.hash_blocks(request.token_ids, request.extras, len(hashes),
                                                  hashes[-1] if hashes else None))
        return hashes

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(self, request: KVRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; return the newly allocated block ids.

        `new_computed_blocks` (the lookup's hit, only on a request's first allocation) are
        taken first. The request then holds enough blocks for num_computed_tokens +
        len(hits) * block_size + num_new_tokens tokens. Returns None and changes nothing when
        there are not enough free blocks. Every block that is full once these tokens are
        computed is cached.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        block_size, pool = self.block_size, self._pool
        request_id = request.request_id
        held = self._blocks.get(request_id)
        hits = list(new_computed_blocks)
        if hits:
            self._check_hits(request, held, hits)
        num_held = len(held) if held is not None else 0
        num_tokens_after = request.num_computed_tokens + len(hits) * block_size + num_new_tokens
        num_full_after = min(num_tokens_after, len(request.token_ids)) // block_size
        if self.enable_caching and num_full_after > len(request.block_hashes):
            self._update_hashes(request)  # before any change: hashing rejects bad token ids
        num_needed = max(-(-num_tokens_after // block_size) - num_held - len(hits), 0)
        # Free hit blocks are counted as free but cannot be handed out: they are being reused.
        num_free_hits = list(map(pool.ref_counts.__getitem__, hits)).count(0)
        if num_needed > pool.num_free_blocks - num_free_hits:
            return None
        if hits:
            pool.touch(hits)
        new_blocks = pool.allocate(num_needed, request.ref)
        if held is None:
            held = self._blocks[request_id] = hits
            self._num_cached[request_id] = len(hits)
            if self.enable_caching and not request.counted:
                request.counted = True
                self._queries += len(request.token_ids)
                self._hits += len(hits) * block_size
        held.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, held, num_full_after)
        return new_blocks

    def _check_hits(self, request: KVRequest, held: list[int] | None, hits: list[int]) -> None:
        if held is not None or request.num_computed_tokens:
            raise ValueError("new_computed_blocks may only be given on a request's first allocation "
                             "(no blocks held, num_computed_tokens == 0)")
        if not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        if len(hits) * self.block_size > len(request.token_ids) - 1:
            raise ValueError("new_computed_blocks cover the last token, which must be computed")
        pool = self._pool
        if not 0 <= min(hits) <= max(hits) < pool.num_blocks \
                or list(map(pool.block_hashes.__getitem__, hits)) != request.block_hashes[: len(hits)]:
            raise ValueError("new_computed_blocks are not this request's cached prefix (stale lookup?)")

    def _cache_full_blocks(self, request: KVRequest, blocks: list[int], num_full: int) -> None:
        num_cached = self._num_cached[request.request_id]
        if num_full > num_cached:
            hashes = self._update_hashes(request)
            stored = hashes[num_cached:num_full]
            self._pool.cache(blocks[num_cached:num_full], stored, request.ref)
            self._num_cached[request.request_id] = num_full
            if self._events is not None:
                extras = request.extras
                self._events.stored(stored, hashes[num_cached - 1] if num_cached else None, self.block_size,
                                    lora=extras.lora_name is not None, multimodal=bool(extras.mm_items))

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first. A request holding none is a no-op."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            released = blocks[::-1]
            self._pool.free(released)
            if self.enable_caching:
                self._stack.release([h for h in map(self._pool.block_hashes.__getitem__, released) if h is not None])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (empty if it holds none)."""
        return list(self._blocks.get(request_id, ()))

    # -- cache-wide operations ---------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Refuses (False) while any request holds blocks."""
        if not self._pool.reset():
            return False
        if self._hash_memo is not None:
            self._hash_memo.clear()
        self._stack.clear()  # a reset drops what any cache size would have kept
        if self._events is not None:
            self._events.cleared()
        return True

    def publish_events(self) -> None:
        """Seal the KV events since the last call into one batch of the stream (one per step)."""
        if self._events is not None:
            self._events.publish()

    def cached_hashes(self) -> list[bytes]:
        """Every hash some block holds now: the set the KV events stream describes."""
        return list(self._pool.cached)

    def drain_events(self) -> list[EvictionBatch]:
        """Evictions since the last drain, one batch per evicting allocation (or reset), oldest
        first; iterate a batch for its `EvictionEvent`s."""
        return self._pool.take_events()

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in allocation (and eviction) order, head first. O(free blocks)."""
        return list(self._pool.free_queue)

    @property
    def pool(self) -> BlockPool:
        """The block pool, for inspection; change it only through the manager."""
        return self._pool

    def stats(self) -> CacheStats:
        pool = self._pool
        free = pool.num_free_blocks
        return CacheStats(num_blocks=pool.num_blocks, free_blocks=free, used_blocks=pool.num_blocks - free,
                          cached_blocks=pool.num_cached_blocks, queries=self._queries, hits=self._hits,
                          evictions=pool.num_evictions, events_dropped=pool.events_dropped,
                          idle_cached_blocks=pool.num_idle_cached_blocks)
