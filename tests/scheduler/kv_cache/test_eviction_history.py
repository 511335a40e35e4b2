"""Every miss on an evicted block names its evictor: who took the block, when, and who had stored it
when; and the history of evictions stays bounded."""
from __future__ import annotations

import time

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.scheduler.kv_cache import EvictionBatch, KVCacheManager, KVRequest, RequestRef
from prefixcache.scheduler.kv_cache.eviction_history import EvictionHistory


def manager(num_blocks: int, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BlockHasher(4, "sha256", "m"), **kwargs)


def run(m: KVCacheManager, request: KVRequest) -> None:
    hits, _ = m.get_computed_blocks(request)
    assert m.allocate_slots(request, len(request.token_ids) - len(hits) * 4, hits) is not None
    m.free(request.request_id)


def test_a_miss_on_an_evicted_block_names_who_evicted_it_and_who_had_stored_it() -> None:
    m = manager(6)
    system = KVRequest("system-prompt", list(range(16)), trace_context="span of system-prompt")
    before = time.time_ns()
    run(m, system)
    time.sleep(0.01)
    run(m, KVRequest("thief", list(range(100, 124)), trace_context="span of thief"))  # takes every block
    time.sleep(0.01)
    hits, account = m.get_computed_blocks(KVRequest("again", list(range(16))))
    assert hits == [] and account.miss_reason == "evicted"
    assert account.first_missing_block == system.block_hashes[0]
    eviction = account.eviction
    assert eviction.evicted_by == RequestRef("thief", "span of thief")
    assert eviction.stored_by == RequestRef("system-prompt", "span of system-prompt")
    assert before <= eviction.stored_at_ns < eviction.evicted_at_ns < time.time_ns()
    assert eviction.age_ns >= 10_000_000  # it lived through the first sleep


def test_a_cold_miss_names_its_first_missing_block_and_no_evictor() -> None:
    m = manager(8)
    run(m, KVRequest("a", list(range(8))))
    hits, account = m.get_computed_blocks(KVRequest("b", list(range(4)) + [99] * 8))
    assert len(hits) == 1 and account.miss_reason == "cold" and account.eviction is None
    assert account.first_missing_block is not None
    _, full = m.get_computed_blocks(KVRequest("c", list(range(8)) + [5]))
    assert full.miss_reason == "full_hit" and full.first_missing_block is None


def test_a_reset_forgets_the_evictions_and_later_misses_are_cold() -> None:
    m = manager(4)
    run(m, KVRequest("a", list(range(16))))
    run(m, KVRequest("b", list(range(100, 116))))
    assert m.get_computed_blocks(KVRequest("a2", list(range(16))))[1].miss_reason == "evicted"
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(KVRequest("a3", list(range(16))))[1].miss_reason == "cold"


def test_the_history_keeps_at_least_its_capacity_and_at_most_twice_that_and_a_batch() -> None:
    history = EvictionHistory(100)
    evictor = RequestRef("x")

    def batch(evicting: RequestRef, at: int, hashes: list[bytes]) -> EvictionBatch:
        return EvictionBatch(evicting, "allocation", list(range(len(hashes))), hashes,
                             [RequestRef(f"stored {h.decode()}") for h in hashes], [at - 1] * len(hashes), at)

    for index in range(50):
        history.add(batch(evictor, index, [f"{index}-{i}".encode() for i in range(7)]))
        assert min(7 * (index + 1), 100) <= len(history) < 200 + 7
    record = history.get(b"49-6")
    assert (record.evicted_at_ns, record.stored_by, record.age_ns) == (49, RequestRef("stored 49-6"), 1)
    assert b"49-6" in history and history.get(b"0-0") is None
    history.add(batch(RequestRef("y"), 50, [b"49-6"]))  # evicted again: the newest record wins
    assert history.get(b"49-6").evicted_by == RequestRef("y")


def test_idle_cached_blocks_are_the_cached_blocks_no_request_holds() -> None:
    m = manager(10)
    a = KVRequest("a", list(range(10)))
    hits, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, 10, hits)
    assert (m.stats().cached_blocks, m.stats().idle_cached_blocks) == (2, 0)
    m.free("a")
    assert m.stats().idle_cached_blocks == 2
    b = KVRequest("b", list(range(8)) + [7])
    hits, _ = m.get_computed_blocks(b)
    m.allocate_slots(b, 1, hits)
    assert m.stats().idle_cached_blocks == 0  # both hit, so held
