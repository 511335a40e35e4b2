"""Random add/lookup/allocate/step/free/reset sequences against a reference model of the rules.

The reference is written the obvious way (lists with O(n) removal, no hashing: a block's identity
is its extras plus every token up to its end), so it shares no code with the manager. After every
step the two must agree exactly: hit blocks, accounts, allocated ids, free-queue order, ref counts
and counters; and the pool's own invariants must hold.
"""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.block_identity.hashing import NO_EXTRAS, BlockExtras, BlockHasher
from prefixcache.scheduler.kv_cache import CacheAccount, KVCacheManager, KVRequest

PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51, 52, 53], [7, 7, 7, 7, 7, 7, 7, 7])
EXTRAS = (NO_EXTRAS, BlockExtras(cache_salt="tenant"), BlockExtras(cache_salt="other tenant"),
          BlockExtras(lora_name="adapter", lora_digest=b"\x01"), BlockExtras(lora_name="adapter"))


class ReferenceCache:
    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.block_size, self.caching = block_size, caching
        self.free = list(range(num_blocks))
        self.ref = [0] * num_blocks
        self.identity: list[tuple | None] = [None] * num_blocks
        self.holders: dict[tuple, list[int]] = {}  # identity -> blocks carrying it, oldest first
        self.ever_evicted: set[tuple] = set()
        self.blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        self.queries = self.hits = self.evictions = 0
        self.counted: set[str] = set()

    def identity_of(self, request: KVRequest, index: int) -> tuple:
        return request.extras, tuple(request.token_ids[: (index + 1) * self.block_size])

    def lookup(self, request: KVRequest) -> tuple[list[int], CacheAccount]:
        size, tokens = self.block_size, request.token_ids
        full, tail = len(tokens) // size, len(tokens) % size
        if not self.caching:
            return [], CacheAccount(len(tokens), 0, 0, tail, "disabled", 0, full)
        if full == 0:
            return [], CacheAccount(len(tokens), 0, 0, tail, "no_full_block", 0, 0)
        found = []
        for index in range(full):
            holders = self.holders.get(self.identity_of(request, index))
            if not holders:
                break
            found.append(holders[0])
        hit = found[: (len(tokens) - 1) // size]
        if len(found) == full:
            reason = "full_hit"
        else:
            reason = "evicted" if self.identity_of(request, len(found)) in self.ever_evicted else "cold"
        return hit, CacheAccount(len(tokens), len(hit) * size, (len(found) - len(hit)) * size, tail, reason,
                                 len(hit), full)

    def allocate(self, request: KVRequest, num_new: int, hits: list[int]) -> list[int] | None:
        size, request_id = self.block_size, request.request_id
        held = self.blocks.get(request_id, [])
        total = request.num_computed_tokens + len(hits) * size + num_new
        needed = max(-(-total // size) - len(held) - len(hits), 0)
        if needed > len([b for b in self.free if b not in hits]):
            return None
        for block in hits:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
        new, self.free = self.free[:needed], self.free[needed:]
        for block in new:
            self.ref[block] = 1
            if self.identity[block] is not None:
                self._evict(block)
        if request_id not in self.blocks:
            self.blocks[request_id] = list(hits)
            self.num_cached[request_id] = len(hits)
            if self.caching and request.request_id not in self.counted:  # a preempted one is not counted again
                self.counted.add(request.request_id)
                self.queries += len(request.token_ids)
                self.hits += len(hits) * size
        self.blocks[request_id].extend(new)
        if self.caching:
            full = min(total, len(request.token_ids)) // size
            for index in range(self.num_cached[request_id], full):
                block, identity = self.blocks[request_id][index], self.identity_of(request, index)
                self.identity[block] = identity
                self.holders.setdefault(identity, []).append(block)
            self.num_cached[request_id] = max(self.num_cached[request_id], full)
        return new

    def _evict(self, block: int) -> None:
        identity = self.identity[block]
        self.holders[identity].remove(block)
        if not self.holders[identity]:
            del self.holders[identity]
            self.ever_evicted.add(identity)
        self.identity[block] = None
        self.evictions += 1

    def release(self, request_id: str) -> None:
        for block in reversed(self.blocks.pop(request_id, [])):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.identity[block] is None:
                    self.free.insert(0, block)
                else:
                    self.free.append(block)
        self.num_cached.pop(request_id, None)

    def reset(self) -> bool:
        """Forget every identity, and which were evicted: a reset is neither an eviction nor remembered."""
        if any(self.ref):
            return False
        self.identity = [None] * len(self.identity)
        self.holders.clear()
        self.ever_evicted.clear()
        return True


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(min_value=1, max_value=14), block_size=st.sampled_from([2, 4]),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.manager = KVCacheManager(num_blocks, BlockHasher(block_size, "sha256", "m"), enable_caching=caching)
        self.reference = ReferenceCache(num_blocks, block_size, caching)
        self.waiting: dict[str, KVRequest] = {}
        self.running: dict[str, KVRequest] = {}
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(min_value=0, max_value=9),
          suffix=st.lists(st.integers(min_value=0, max_value=3), max_size=8), extras=st.sampled_from(EXTRAS))
    def add_request(self, prefix, cut, suffix, extras) -> None:
        tokens = prefix[:cut] + suffix or [0]
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[request_id] = KVRequest(request_id, tokens, extras)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data) -> None:
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        hits, account = self.manager.get_computed_blocks(request)
        assert (hits, account) == self.reference.lookup(request)
        hit_tokens = len(hits) * self.manager.block_size
        num_new = data.draw(st.integers(min_value=1, max_value=len(request.token_ids) - hit_tokens))
        new = self.manager.allocate_slots(request, num_new, hits)
        assert new == self.reference.allocate(request, num_new, hits)
        if new is not None:
            request.num_computed_tokens = hit_tokens + num_new
            self.running[request.request_id] = self.waiting.pop(request.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(min_value=0, max_value=3))
    def step(self, data, token) -> None:
        """A prefill chunk, or a decode step (the sampled token joins the sequence first)."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        remaining = len(request.token_ids) - request.num_computed_tokens
        if remaining:
            num_new = data.draw(st.integers(min_value=1, max_value=remaining))
        else:
            request.token_ids.append(token)
            num_new = 1
        new = self.manager.allocate_slots(request, num_new)
        assert new == self.reference.allocate(request, num_new, [])
        if new is None:  # preempt it: the scheduler frees it and will recompute from its cached prefix
            self.manager.free(request.request_id)
            self.reference.release(request.request_id)
            request.num_computed_tokens = 0
            self.waiting[request.request_id] = self.running.pop(request.request_id)
        else:
            request.num_computed_tokens += num_new

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        self.manager.free(request_id)
        self.reference.release(request_id)
        self.running.pop(request_id, None) or self.waiting.pop(request_id)

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == self.reference.reset()

    @invariant()
    def agrees_with_reference_and_pool_is_consistent(self) -> None:
        if not hasattr(self, "manager"):
            return
        pool, reference = self.manager.pool, self.reference
        free = self.manager.free_block_ids()
        assert all(count >= 0 for count in pool.ref_counts)
        assert len(set(free)) == len(free), "a block is twice in the free queue"
        assert set(free) == {b for b in range(self.num_blocks) if pool.ref_counts[b] == 0}
        assert free == reference.free
        assert pool.ref_counts == reference.ref
        hashed = [b for b, h in enumerate(pool.block_hashes) if h is not None]
        for block_hash in pool.cached:
            holders = pool.blocks_with_hash(block_hash)
            assert holders and all(pool.block_hashes[b] == block_hash for b in holders)
        assert sorted(b for h in pool.cached for b in pool.blocks_with_hash(h)) == hashed
        assert [b for b in range(self.num_blocks) if reference.identity[b] is not None] == hashed
        stats = self.manager.stats()
        assert (stats.queries, stats.hits, stats.evictions, stats.cached_blocks, stats.free_blocks) == (
            reference.queries, reference.hits, reference.evictions, len(hashed), len(free))
        assert stats.idle_cached_blocks == len([b for b in free if pool.block_hashes[b] is not None])
        hasher = self.manager.hasher
        for request in (*self.running.values(), *self.waiting.values()):
            assert self.manager.get_block_ids(request.request_id) == reference.blocks.get(request.request_id, [])
            # Hashes recalled from the manager's memo are exactly the hasher's.
            hashed_tokens = request.token_ids[: len(request.block_hashes) * hasher.block_size]
            assert request.block_hashes == hasher.hash_blocks(hashed_tokens, request.extras)

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request_id in [*self.running, *self.waiting]:
            self.manager.free(request_id)
        assert self.manager.num_free_blocks == self.num_blocks
        assert self.manager.stats().used_blocks == 0


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheManagerStateful = KVCacheMachine.TestCase
