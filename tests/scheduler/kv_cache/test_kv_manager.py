"""KVCacheManager rules, with exact block ids and free-queue orders (block size 4 unless noted)."""
from __future__ import annotations

import pytest

from prefixcache.block_identity.hashing import BlockExtras, BlockHasher, MultiModalItem
from prefixcache.scheduler.kv_cache import EvictionEvent, KVCacheManager, KVRequest

MODEL = "test-model@1"


def manager(num_blocks: int = 10, block_size: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BlockHasher(block_size, "sha256", MODEL), **kwargs)


def admit(m: KVCacheManager, request: KVRequest, num_new: int | None = None):
    """What the scheduler does on admission: lookup, allocate, advance the computed count."""
    hits, account = m.get_computed_blocks(request)
    hit_tokens = len(hits) * m.block_size
    num_new = len(request.token_ids) - hit_tokens if num_new is None else num_new
    new = m.allocate_slots(request, num_new, hits)
    if new is not None:
        request.num_computed_tokens = hit_tokens + num_new
    return hits, new, account


def drained_events(m: KVCacheManager) -> list[EvictionEvent]:
    """The pending eviction events, one per block, flattened out of their batches."""
    return [event for batch in m.drain_events() for event in batch]


def test_prefill_then_free_orders_the_free_queue():
    m = manager()
    a = KVRequest("a", list(range(100, 110)))  # 2 full blocks + 2 tokens
    hits, new, account = admit(m, a)
    assert (hits, new) == ([], [0, 1, 2])
    assert account.miss_reason == "cold" and account.partial_tail_tokens == 2
    assert m.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]
    assert m.stats().cached_blocks == 2
    m.free("a")
    # Released 2, 1, 0: the unhashed partial block to the head, cached blocks to the tail.
    assert m.free_block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = KVRequest("b", list(range(100, 108)) + [50, 51, 52])
    hits, new, account = admit(m, b)
    assert (hits, new) == ([0, 1], [2])
    assert (account.hit_tokens, account.queried_tokens, account.miss_reason) == (8, 11, "full_hit")
    assert m.get_block_ids("b") == [0, 1, 2]
    assert m.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]
    stats = m.stats()
    assert (stats.queries, stats.hits, stats.used_blocks, stats.free_blocks) == (21, 8, 3, 7)


def test_eviction_is_lru_and_takes_a_requests_tail_first():
    m = manager(num_blocks=6)
    a = KVRequest("a", list(range(12)))
    admit(m, a)
    m.free("a")
    assert m.free_block_ids() == [3, 4, 5, 2, 1, 0]
    _, new, _ = admit(m, KVRequest("c", list(range(500, 516))))
    assert new == [3, 4, 5, 2]
    [event] = drained_events(m)
    assert (event.block_hash, event.block_id, event.evicting_request_id, event.storing_request_id,
            event.reason) == (a.block_hashes[2], 2, "c", "a", "allocation")
    assert m.drain_events() == []
    hits, account = m.get_computed_blocks(KVRequest("a2", list(range(12))))
    assert hits == [0, 1]
    assert (account.hit_tokens, account.capped_tokens, account.miss_reason) == (8, 0, "evicted")
    assert m.stats().evictions == 1


def test_seed_shared_system_prompt_repeat_lora_and_empty():
    m = manager(num_blocks=200, block_size=16)
    system = list(range(1000))
    a = KVRequest("a", system + [7] * 200)
    admit(m, a)
    m.free("a")
    hits, account = m.get_computed_blocks(KVRequest("b", system + [9] * 200))
    assert (len(hits), account.hit_tokens) == (62, 992)
    hits, account = m.get_computed_blocks(KVRequest("a-again", system + [7] * 200))
    assert (account.hit_tokens, account.capped_tokens, account.miss_reason) == (1184, 16, "full_hit")
    assert hits == list(range(74))
    _, account = m.get_computed_blocks(KVRequest("lora", system + [7] * 200, BlockExtras(lora_name="x")))
    assert (account.hit_tokens, account.miss_reason) == (0, "cold")
    hits, account = m.get_computed_blocks(KVRequest("empty", []))
    assert (hits, account.hit_tokens, account.miss_reason, account.queried_blocks) == ([], 0, "no_full_block", 0)


def test_seed_lcp_arrays_with_block_size_four():
    m = manager()
    admit(m, KVRequest("A", [11, 12, 13, 14, 15, 16, 17, 18]))
    m.free("A")
    expected = {"B": ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 8),  # LCP 8
                "C": ([11, 12, 13, 14, 15, 16, 90, 91], 4),  # LCP 6 -> floor(6/4)*4
                "D": ([11, 12, 13, 99, 15, 16, 17, 18], 0)}  # LCP 3
    for name, (tokens, hit) in expected.items():
        assert m.get_computed_blocks(KVRequest(name, tokens))[1].hit_tokens == hit, name


def test_full_hit_recomputes_the_whole_last_block():
    m = manager()
    admit(m, KVRequest("a", list(range(8))))
    m.free("a")
    hits, account = m.get_computed_blocks(KVRequest("b", list(range(8))))
    assert hits == [0]
    assert (account.hit_tokens, account.capped_tokens, account.partial_tail_tokens, account.miss_reason,
            account.hit_blocks, account.queried_blocks) == (4, 4, 0, "full_hit", 1, 2)


def test_lookup_is_pure():
    m = manager()
    admit(m, KVRequest("a", list(range(8))))
    m.free("a")
    before = (m.free_block_ids(), m.stats())
    m.get_computed_blocks(KVRequest("b", list(range(9))))
    assert (m.free_block_ids(), m.stats()) == before


def test_decode_fills_blocks_that_are_cached_and_hit_by_the_next_turn():
    m = manager()
    a = KVRequest("a", [1, 2, 3, 4, 5, 6])
    admit(m, a)
    assert len(a.block_hashes) == 1 and m.stats().cached_blocks == 1
    for token in (7, 8):  # decode: the sampled token joins the sequence, then its KV is computed
        a.token_ids.append(token)
        assert m.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    assert m.stats().cached_blocks == 2
    a.token_ids.append(9)
    assert m.allocate_slots(a, 1) == [2]  # a ninth token needs a third block
    a.num_computed_tokens += 1
    m.free("a")
    turn2 = KVRequest("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    hits, account = m.get_computed_blocks(turn2)
    assert hits == [0, 1] and account.hit_tokens == 8


class CountingHasher(BlockHasher):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[tuple[int, int]] = []

    def hash_blocks(self, token_ids, extras, start_block=0, parent=None):
        hashes = super().hash_blocks(token_ids, extras, start_block, parent)
        self.calls.append((start_block, len(hashes)))
        return hashes


def test_hashes_are_extended_incrementally_never_recomputed():
    hasher = CountingHasher(4, "sha256", MODEL)
    m = KVCacheManager(10, hasher)
    a = KVRequest("a", list(range(10)))
    admit(m, a)
    for token in range(10, 20):
        a.token_ids.append(token)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert hasher.calls == [(0, 2), (2, 1), (3, 1), (4, 1)]  # one new block every 4 tokens
    assert a.block_hashes == hasher.hash_blocks(a.token_ids, a.extras)


def test_not_enough_blocks_changes_nothing():
    m = manager(num_blocks=4)
    a = KVRequest("a", list(range(8)))
    admit(m, a)
    m.free("a")
    assert m.free_block_ids() == [2, 3, 1, 0]
    before = m.stats()
    b = KVRequest("b", list(range(17)))  # hits blocks 0 and 1, needs 3 more; only 2 can be handed out
    hits, account = m.get_computed_blocks(b)
    assert hits == [0, 1]
    assert m.allocate_slots(b, 9, hits) is None
    assert m.free_block_ids() == [2, 3, 1, 0]
    assert m.stats() == before and m.get_block_ids("b") == []
    assert m.allocate_slots(b, 8, hits) == [2, 3]  # 16 tokens fit


def test_blocks_of_running_requests_are_never_evicted():
    m = manager(num_blocks=4)
    admit(m, KVRequest("a", list(range(8))))
    assert admit(m, KVRequest("c", list(range(100, 108))))[1] == [2, 3]
    assert admit(m, KVRequest("d", [1, 2, 3]))[1] is None
    assert m.stats().evictions == 0 and m.stats().cached_blocks == 4


def test_a_hit_on_a_block_in_use_shares_it():
    m = manager()
    a = KVRequest("a", list(range(9)))
    admit(m, a)
    hits, new, _ = admit(m, KVRequest("b", list(range(9))))
    assert (hits, new) == ([0, 1], [3])
    assert m.pool.ref_counts[:4] == [2, 2, 1, 1]
    m.free("a")
    assert m.pool.ref_counts[:4] == [1, 1, 0, 1] and m.free_block_ids()[0] == 2
    m.free("b")
    assert m.free_block_ids() == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]


def test_duplicate_blocks_with_one_hash_are_tolerated():
    m = manager(num_blocks=6)
    a, b = KVRequest("a", list(range(5))), KVRequest("b", list(range(5)))
    hits_a, _ = m.get_computed_blocks(a)
    hits_b, _ = m.get_computed_blocks(b)  # both miss: neither has allocated yet
    assert m.allocate_slots(a, 5, hits_a) == [0, 1]
    assert m.allocate_slots(b, 5, hits_b) == [2, 3]
    assert m.pool.blocks_with_hash(a.block_hashes[0]) == [0, 2]
    assert m.stats().cached_blocks == 2
    m.free("a")
    m.free("b")
    assert m.free_block_ids() == [3, 1, 4, 5, 0, 2]
    # Allocating 5 blocks evicts block 0; block 2 still holds the hash and serves the next hit.
    assert admit(m, KVRequest("c", list(range(100, 120))))[1] == [3, 1, 4, 5, 0]
    # Block 0's KV is gone (an event per block), but the hash survives in block 2.
    assert [(e.block_id, e.block_hash) for e in drained_events(m)] == [(0, a.block_hashes[0])]
    assert m.pool.blocks_with_hash(a.block_hashes[0]) == [2]
    assert m.get_computed_blocks(KVRequest("d", list(range(5))))[0] == [2]


def test_reset_refuses_while_blocks_are_held_then_forgets_everything():
    m = manager()
    a = KVRequest("a", list(range(8)))
    admit(m, a)
    assert m.reset_prefix_cache() is False
    assert m.stats().cached_blocks == 2
    m.free("a")
    order = m.free_block_ids()
    assert m.reset_prefix_cache() is True
    assert m.free_block_ids() == order and m.stats().cached_blocks == 0
    events = drained_events(m)
    assert [(e.block_id, e.evicting_request_id, e.storing_request_id, e.reason) for e in events] == [
        (0, None, "a", "reset"), (1, None, "a", "reset")]
    # A reset is no eviction pressure: what it dropped, and what was evicted before it, misses "cold".
    hits, account = m.get_computed_blocks(KVRequest("b", list(range(8))))
    assert (hits, account.miss_reason) == ([], "cold")


def test_a_reset_forgets_earlier_evictions_too():
    m = manager(num_blocks=4)
    admit(m, KVRequest("a", list(range(8))))
    m.free("a")
    admit(m, KVRequest("b", list(range(100, 116))))  # takes all four blocks: a's two are evicted
    m.free("b")
    assert m.get_computed_blocks(KVRequest("c", list(range(8))))[1].miss_reason == "evicted"
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(KVRequest("c", list(range(8))))[1].miss_reason == "cold"
    assert m.stats().evictions == 2  # a's blocks, to make room; the reset dropping b's four is no eviction


def test_disabled_caching_hashes_nothing_and_reuses_freed_blocks_first():
    m = manager(enable_caching=False)
    a = KVRequest("a", list(range(9)))
    hits, new, account = admit(m, a)
    assert (hits, new, account.miss_reason, a.block_hashes) == ([], [0, 1, 2], "disabled", [])
    m.free("a")
    assert m.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    hits, new, account = admit(m, KVRequest("b", list(range(9))))
    assert (hits, new, account.hit_tokens) == ([], [0, 1, 2], 0)
    assert m.stats().cached_blocks == 0 and m.stats().queries == 0  # nothing was looked up


def test_salts_isolate_tenants():
    m = manager()
    admit(m, KVRequest("a", list(range(9)), BlockExtras(cache_salt="tenant-1")))
    assert m.get_computed_blocks(KVRequest("b", list(range(9)), BlockExtras(cache_salt="tenant-2")))[0] == []
    assert m.get_computed_blocks(KVRequest("c", list(range(9))))[0] == []
    assert m.get_computed_blocks(KVRequest("d", list(range(9)), BlockExtras(cache_salt="tenant-1")))[0] == [0, 1]


def test_multimodal_items_change_only_the_blocks_they_overlap():
    m = manager()
    tokens = [1, 2, 3, 4, 0, 0, 0, 0, 9]
    admit(m, KVRequest("a", tokens, BlockExtras(mm_items=(MultiModalItem("cat.png#1", 4, 4),))))
    other_image = BlockExtras(mm_items=(MultiModalItem("dog.png#2", 4, 4),))
    assert m.get_computed_blocks(KVRequest("b", tokens, other_image))[0] == [0]
    same_image = BlockExtras(mm_items=(MultiModalItem("cat.png#1", 4, 4),))
    assert m.get_computed_blocks(KVRequest("c", tokens, same_image))[0] == [0, 1]


def test_bad_input_raises_and_leaves_state_alone():
    m = manager()
    a = KVRequest("a", list(range(8)))
    admit(m, a)
    m.free("a")
    before = (m.free_block_ids(), m.stats())
    b = KVRequest("b", list(range(8)))
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(b, -1)
    with pytest.raises(ValueError, match="last token"):
        m.allocate_slots(b, 0, [0, 1])  # a hit may not cover the token that produces logits
    with pytest.raises(ValueError, match="stale lookup"):
        m.allocate_slots(b, 4, [1])  # block 1 is not b's first block
    with pytest.raises(ValueError, match="stale lookup"):
        m.allocate_slots(b, 4, [99])
    bad_token = KVRequest("bad", [1, 2, 3, -1, 5])  # rejected by hashing, which runs before any change
    with pytest.raises(ValueError, match="token ids"):
        m.allocate_slots(bad_token, 5)
    assert m.get_block_ids("bad") == []
    assert (m.free_block_ids(), m.stats()) == before
    m.allocate_slots(b, 8)
    with pytest.raises(ValueError, match="first allocation"):
        m.allocate_slots(b, 1, [0])
    m.free("never-seen")  # documented no-op
    m.free("b")
    m.free("b")
    assert m.num_free_blocks == 10
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, BlockHasher(4, "sha256", MODEL))
    with pytest.raises(ValueError, match="hasher"):
        KVCacheManager(4, "sha256")


def test_a_hit_evicted_between_lookup_and_allocation_is_rejected():
    m = manager(num_blocks=4)
    admit(m, KVRequest("a", list(range(8))))
    m.free("a")
    b = KVRequest("b", list(range(9)))
    hits, _ = m.get_computed_blocks(b)
    admit(m, KVRequest("c", list(range(100, 116))))  # takes all four blocks, evicting a's
    m.free("c")
    with pytest.raises(ValueError, match="stale lookup"):
        m.allocate_slots(b, 1, hits)


def test_pending_events_are_bounded_and_drops_are_counted():
    m = manager(num_blocks=4, max_pending_events=2)
    admit(m, KVRequest("a", list(range(16))))
    m.free("a")
    admit(m, KVRequest("b", list(range(100, 116))))
    # One allocation evicted four blocks (a's tail first); only the newest two events are kept.
    assert [(e.block_id, e.storing_request_id) for e in drained_events(m)] == [(1, "a"), (0, "a")]
    assert m.stats().evictions == 4 and m.stats().events_dropped == 2


def test_preempted_request_resumes_from_its_cached_blocks():
    m = manager(num_blocks=4)
    a = KVRequest("a", list(range(10)))
    admit(m, a)
    m.free("a")  # preempted: the scheduler resets the computed count
    a.num_computed_tokens = 0
    hits, new, account = admit(m, a)
    assert (hits, new, account.hit_tokens) == ([0, 1], [2], 8)
    # The recompute is not a new query: the counters keep the first allocation's prompt and hit.
    assert (m.stats().queries, m.stats().hits) == (10, 0)
