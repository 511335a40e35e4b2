"""LRU stack distances against the obvious model (a list, most recent last), and the what-if hits they
give against real caches of those sizes."""
from __future__ import annotations

import random

import pytest

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.scheduler.kv_cache import WHAT_IF_FACTORS, KVCacheManager, KVRequest
from prefixcache.scheduler.kv_cache import stack_distance as stack_module
from prefixcache.scheduler.kv_cache.stack_distance import StackDistances


def brute_reach(stack: list[bytes], hashes: list[bytes], limit: int) -> list[int]:
    reach, farthest = [], -1
    for block_hash in hashes:
        if block_hash not in stack:
            break
        farthest = max(farthest, len(stack) - 1 - stack.index(block_hash))
        reach.append(farthest)
        if farthest >= limit:
            break
    return reach


@pytest.mark.parametrize("renumber_every", [1024, 4], ids=["default", "renumbering-often"])
def test_reach_is_the_lru_stack_distance(monkeypatch: pytest.MonkeyPatch, renumber_every: int) -> None:
    """Random releases and lookups: every reach equals the one a plain list computes, for hashes within
    `depth` (one beyond it may be reported or forgotten: whole batches are dropped)."""
    monkeypatch.setattr(stack_module, "_MIN_SLOTS", renumber_every)
    for seed in range(150):
        rng = random.Random(seed)
        depth = rng.randint(1, 40)
        distances, stack = StackDistances(depth), []
        universe = [bytes([i + 1]) for i in range(rng.randint(2, 60))]
        for _ in range(rng.randint(1, 300)):
            if rng.random() < 0.5:
                released = rng.sample(universe, min(rng.randint(0, 10), len(universe)))
                distances.release(released)
                stack = [h for h in stack if h not in released] + released
            else:
                looked_up = rng.sample(universe, rng.randint(1, min(8, len(universe))))
                limit = rng.randint(1, depth)
                expected = brute_reach(stack, looked_up, limit)
                got = distances.reach(looked_up, limit)
                assert got == expected or (expected[-1] >= depth and got == expected[:-1]), (seed, got, expected)
            assert min(len(stack), depth) <= len(distances) <= len(stack)


def test_the_stack_stays_about_depth_deep() -> None:
    distances = StackDistances(100)
    for batch in range(1000):
        distances.release([f"{batch}-{i}".encode() for i in range(7)])
    assert 100 <= len(distances) < 107
    assert distances.reach([b"999-6"], 10) == [0] and distances.reach([b"0-0"], 10) == []


def one_at_a_time(manager: KVCacheManager, prompts: list[list[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """Each prompt admitted alone, computed and released: (hit tokens, what-if hit tokens) per prompt."""
    results = []
    for index, prompt in enumerate(prompts):
        request = KVRequest(f"r{index}", list(prompt))
        hits, account = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, len(prompt) - len(hits) * manager.block_size, hits) is not None
        results.append((account.hit_tokens, manager.lookup_record(request, account).what_if_hit_tokens))
        manager.free(request.request_id)
    return results


def test_what_if_hits_are_the_hits_of_a_cache_that_size() -> None:
    """Prompts of whole blocks, each ending in a block of its own, one at a time: the pool is then exactly
    LRU over releases, so what the 40-block cache predicts for a cache of f x 40 blocks is, lookup by
    lookup, what one of that size hits. (A prompt matched in full recomputes its last block into a
    copy, which takes a block of the pool until evicted: that the model does not count.)"""
    block_size, num_blocks = 4, 40
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(block_size * rng.randint(1, 4))] for _ in range(12)]
    prompts = []
    for index in range(400):
        own = [rng.randrange(1000) for _ in range(block_size * rng.randint(0, 2))] + [1000 + index] * block_size
        prompts.append((list(rng.choice(prefixes)) + own)[-8 * block_size:])

    def manager(blocks: int) -> KVCacheManager:
        return KVCacheManager(blocks, BlockHasher(block_size, "sha256", "m"))

    predicted = one_at_a_time(manager(num_blocks), prompts)
    assert [hits for hits, what_if in predicted] == [what_if[WHAT_IF_FACTORS.index(1.0)] for _, what_if in predicted]
    for index, factor in enumerate(WHAT_IF_FACTORS):
        if round(factor * num_blocks) < 8:
            continue  # too small for the longest prompt
        measured = [hits for hits, _ in one_at_a_time(manager(round(factor * num_blocks)), prompts)]
        assert measured == [what_if[index] for _, what_if in predicted], factor
    assert len({what_if for _, what_if in predicted}) > 3  # the sizes disagree on many lookups
