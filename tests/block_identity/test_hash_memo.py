"""BlockHashMemo: recalled hashes are the hasher's, keyed by everything that names a block."""
from __future__ import annotations

import random

import pytest

from prefixcache.block_identity.hash_memo import BlockHashMemo
from prefixcache.block_identity.hashing import NO_EXTRAS, BlockExtras, BlockHasher, MultiModalItem
from prefixcache.scheduler.kv_cache import KVCacheManager, KVRequest

HASHER = BlockHasher(4, "sha256", "test-model@1")


def remembered(tokens: list[int], extras: BlockExtras = NO_EXTRAS, capacity: int = 100) -> BlockHashMemo:
    memo = BlockHashMemo(4, capacity)
    hashes = HASHER.hash_blocks(tokens, extras)
    memo.remember(tokens, extras, hashes, 0, len(hashes))
    return memo


def test_recall_returns_the_hashers_hashes_up_to_the_first_block_not_remembered():
    tokens = list(range(40, 80))  # 10 blocks
    memo = remembered(tokens[:24])  # blocks 0-5
    assert memo.recall(tokens) == HASHER.hash_blocks(tokens)[:6]
    assert memo.recall(tokens[:23]) == HASHER.hash_blocks(tokens)[:5]  # only full blocks
    changed = tokens[:9] + [7] + tokens[10:]  # block 2 differs
    assert memo.recall(changed) == HASHER.hash_blocks(tokens)[:2]
    assert memo.recall([999] + tokens[1:]) == []
    assert memo.recall(tokens[:3]) == []


def test_remembering_a_later_range_extends_the_chain():
    tokens = list(range(200, 240))
    hashes = HASHER.hash_blocks(tokens)
    memo = BlockHashMemo(4, 100)
    memo.remember(tokens, NO_EXTRAS, hashes, 0, 3)
    memo.remember(tokens, NO_EXTRAS, hashes, 3, 7)
    assert memo.recall(tokens) == hashes[:7]
    assert len(memo) == 7


@pytest.mark.parametrize("other", [
    BlockExtras(cache_salt="tenant-b"),
    NO_EXTRAS,
    BlockExtras(cache_salt="tenant-a", lora_name="adapter", lora_digest=b"\x01"),
])
def test_block_zeros_extra_is_part_of_the_key(other):
    tokens = list(range(16))
    memo = remembered(tokens, BlockExtras(cache_salt="tenant-a"))
    assert memo.recall(tokens, BlockExtras(cache_salt="tenant-a")) == HASHER.hash_blocks(
        tokens, BlockExtras(cache_salt="tenant-a"))
    assert memo.recall(tokens, other) == []


def test_a_lora_request_recalls_its_own_chain():
    tokens = list(range(16))
    lora = BlockExtras(lora_name="adapter", lora_digest=b"\x02")
    memo = remembered(tokens, lora)
    memo.remember(tokens, NO_EXTRAS, HASHER.hash_blocks(tokens), 0, 4)
    assert memo.recall(tokens, lora) == HASHER.hash_blocks(tokens, lora)
    assert memo.recall(tokens) == HASHER.hash_blocks(tokens)
    assert HASHER.hash_blocks(tokens, lora) != HASHER.hash_blocks(tokens)


def test_extras_that_vary_by_block_are_neither_remembered_nor_recalled():
    tokens = list(range(16))
    mm = BlockExtras(mm_items=(MultiModalItem("img", 2, 8),))
    memo = remembered(tokens, mm)
    assert len(memo) == 0 and memo.recall(tokens, mm) == []


def test_ids_beyond_32_bits_are_hashed_not_remembered():
    tokens = [1, 2, 3, 1 << 40, 5, 6, 7, 8]
    memo = remembered(tokens)
    assert len(memo) == 0 and memo.recall(tokens) == []
    assert memo.recall([-1, 2, 3, 4]) == []  # the hasher, not the memo, rejects it


def test_two_generations_keep_what_is_in_use_and_drop_the_rest():
    memo = BlockHashMemo(4, capacity=3)
    prompts = [[seed] * 4 for seed in range(6)]  # one block each
    hot = prompts[0]
    for prompt in prompts[:3]:  # fills the newer generation: it becomes the older one
        memo.remember(prompt, NO_EXTRAS, HASHER.hash_blocks(prompt), 0, 1)
    assert memo.recall(hot) == HASHER.hash_blocks(hot)  # found in the older one: copied to the newer
    for prompt in prompts[3:5]:  # the newer fills again; the old older one, with prompts 1 and 2, goes
        memo.remember(prompt, NO_EXTRAS, HASHER.hash_blocks(prompt), 0, 1)
    assert memo.recall(hot) == HASHER.hash_blocks(hot)
    assert memo.recall(prompts[1]) == [] and memo.recall(prompts[2]) == []
    assert len(memo) <= 2 * memo.capacity


def test_a_prefix_longer_than_a_generation_is_recalled_whole():
    memo = BlockHashMemo(4, capacity=4)
    prompt = list(range(24))  # 6 blocks: remembering them turns the generations over once
    hashes = HASHER.hash_blocks(prompt)
    memo.remember(prompt, NO_EXTRAS, hashes, 0, 6)
    # Blocks 0-3 sit in the older generation; keeping them in use turns it over again, which must
    # not cut the walk short.
    assert memo.recall(prompt) == hashes
    assert memo.recall(prompt) == hashes


def test_manager_recalls_a_cached_prefix_instead_of_hashing_it():
    calls = []

    class CountingHasher(BlockHasher):
        def hash_blocks(self, token_ids, extras=NO_EXTRAS, start_block=0, parent=None):
            hashes = super().hash_blocks(token_ids, extras, start_block, parent)
            calls.append((start_block, len(hashes)))
            return hashes

    hasher = CountingHasher(4, "sha256", "test-model@1")
    m = KVCacheManager(32, hasher)
    system = list(range(100, 132))  # 8 blocks
    for turn in range(3):
        request = KVRequest(f"r{turn}", system + [turn] * 5)  # + 1 block and a partial one
        hits, account = m.get_computed_blocks(request)
        assert request.block_hashes == BlockHasher(4, "sha256", "test-model@1").hash_blocks(request.token_ids)
        m.allocate_slots(request, len(request.token_ids) - len(hits) * 4, hits)
        m.free(request.request_id)
    # r0 hashes all 9 blocks; r1 finds the 8 system blocks cached, hashed again, and remembers them;
    # r2 recalls them and hashes only its own block.
    assert calls == [(0, 9), (0, 9), (8, 1)]
    assert m.reset_prefix_cache()
    m.get_computed_blocks(KVRequest("after-reset", system + [1] * 5))
    assert calls[-1] == (0, 9)  # a reset forgets the memo too


def test_a_lookup_that_hashing_rejects_leaves_the_request_without_recalled_hashes():
    m = KVCacheManager(32, HASHER)
    system = list(range(100, 132))  # 8 blocks, remembered by the second lookup that finds them
    for name in ("first", "second"):
        request = KVRequest(name, system + [1] * 5)
        hits, _ = m.get_computed_blocks(request)
        m.allocate_slots(request, len(request.token_ids) - len(hits) * 4, hits)
        m.free(name)
    bad = KVRequest("bad", system + [1, 2, 3, -1, 5])  # the memo holds its first 8 blocks' hashes
    with pytest.raises(ValueError, match="token ids"):
        m.get_computed_blocks(bad)
    assert bad.block_hashes == []
    good = KVRequest("good", system + [1] * 5)
    assert m.get_computed_blocks(good)[1].hit_blocks == 9


def test_random_prompts_hash_alike_through_the_manager_and_the_hasher():
    rng = random.Random(7)
    hasher = BlockHasher(4, "xxhash", "test-model@1", seed=5)
    m = KVCacheManager(64, hasher)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(40))] for _ in range(4)]
    extras = (NO_EXTRAS, BlockExtras(cache_salt="s"), BlockExtras(lora_name="l", lora_digest=b"\x03"))
    for index in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(12))] or [0]
        request = KVRequest(f"r{index}", tokens, rng.choice(extras))
        hits, _ = m.get_computed_blocks(request)
        assert request.block_hashes == hasher.hash_blocks(tokens, request.extras)
        if m.allocate_slots(request, len(tokens) - len(hits) * 4, hits) is not None:
            m.free(request.request_id)


def test_a_salt_is_kept_only_as_a_digest():
    salt = "s" * 100_000
    memo = remembered(list(range(4)), BlockExtras(cache_salt=salt))
    (key,) = memo._newer  # the one stored key
    assert salt.encode() not in b"".join(key[1:])
    assert sum(map(len, key[1:])) == 16 + 32


def test_the_manager_keeps_no_memo_where_recalling_costs_as_much_as_hashing():
    xxhash_manager = KVCacheManager(8, BlockHasher(4, "xxhash", "test-model@1", seed=1))
    uncached = KVCacheManager(8, BlockHasher(4, "sha256", "test-model@1"), enable_caching=False)
    for m in (xxhash_manager, uncached):
        for name in ("a", "b"):
            request = KVRequest(name, list(range(9)))
            hits, _ = m.get_computed_blocks(request)
            m.allocate_slots(request, 9 - 4 * len(hits), hits)
            m.free(name)
        assert m._hash_memo is None
    assert xxhash_manager.reset_prefix_cache()
