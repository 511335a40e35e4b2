"""Decode staging: keys and values kept between steps give the same attention, bit for bit, as gathers.

Each test drives several decode steps the way the worker does (write this step's keys and values into
the cache, then attend, layer by layer) through a staging backend and a gathering one on the same
caches, and compares every output with `torch.equal`.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache.kernels import AttentionMetadata
from prefixcache.kernels.backends import TorchAttentionBackend
from prefixcache.kernels.cpu.decode_staging import DecodeStaging

BLOCK = 4
NUM_BLOCKS = 96
KV_HEADS, QUERIES_PER_KV, HEAD_DIM = 2, 3, 8
LAYERS = 2


class Decodes:
    """Sequences decoding one token a step over scattered blocks of two layers' caches."""

    def __init__(self, lens: list[int], seed: int = 0, shared_blocks: int = 0) -> None:
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
        self.caches = [(self.random(*shape), self.random(*shape)) for _ in range(LAYERS)]
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.shared = [self.free.pop() for _ in range(shared_blocks)]  # a cached prefix every sequence starts with
        self.lens: list[int] = []
        self.tables: list[list[int]] = []
        for length in lens:
            self.join(length)

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def join(self, length: int) -> None:
        """A sequence whose first `length - 1` positions are in the cache starts decoding."""
        self.lens.append(length - 1)
        own_blocks = -(-(length - 1) // BLOCK) - len(self.shared)
        self.tables.append(self.shared + [self.free.pop() for _ in range(own_blocks)])

    def leave(self, index: int) -> None:
        del self.lens[index]
        self.free.extend(self.tables.pop(index)[len(self.shared):])

    def step(self, backends: list[TorchAttentionBackend],
             attend_layers: range = range(LAYERS)) -> list[list[torch.Tensor]]:
        """One decode for every sequence; per backend, the attention output of each layer in `attend_layers`
        (every layer's keys and values are written)."""
        for index, length in enumerate(self.lens):
            if length % BLOCK == 0:
                self.tables[index].append(self.free.pop())
            self.lens[index] = length + 1
        num = len(self.lens)
        outputs: list[list[torch.Tensor]] = [[] for _ in backends]
        # One step's metadata, shared by its layers (each backend plans the step once, on layer 0).
        metas = [AttentionMetadata.build([1] * num, list(self.lens), self.tables, BLOCK, "cpu") for _ in backends]
        for layer in range(LAYERS):
            key_cache, value_cache = self.caches[layer]
            query = self.random(num, KV_HEADS * QUERIES_PER_KV, HEAD_DIM)
            key, value = self.random(num, KV_HEADS, HEAD_DIM), self.random(num, KV_HEADS, HEAD_DIM)
            for backend, meta, layer_outputs in zip(backends, metas, outputs):
                backend.write_kv(key, value, key_cache, value_cache, meta)
                if layer in attend_layers:
                    layer_outputs.append(backend.attend(query, key, value, key_cache, value_cache, meta,
                                                        HEAD_DIM**-0.5))
        return outputs


def staging_backend(max_positions: int = 10_000, min_group_positions: int = 0) -> TorchAttentionBackend:
    return TorchAttentionBackend(DecodeStaging(max_positions, min_group_positions))


def staged_groups(backend: TorchAttentionBackend) -> list:
    return list(backend._staging._groups.values())


def assert_same(outputs: list[list[torch.Tensor]]) -> None:
    staged, gathered = outputs
    assert all(torch.equal(a, b) for a, b in zip(staged, gathered, strict=True))


def test_staged_decodes_match_gathers_bit_for_bit_as_they_grow_join_and_leave():
    decodes = Decodes([9, 11, 12])
    staging, gathering = staging_backend(), TorchAttentionBackend()
    backends = [staging, gathering]

    assert_same(decodes.step(backends))
    [group] = staged_groups(staging)
    for _ in range(6):  # crosses block boundaries: each member gets new blocks on the way
        assert_same(decodes.step(backends))
        [continued] = staged_groups(staging)
        assert continued is group  # continued, not gathered again
    assert sorted(group.lens) == sorted(decodes.lens)  # longest first in the group

    decodes.leave(1)
    assert_same(decodes.step(backends))
    [regathered] = staged_groups(staging)
    assert regathered is not group
    decodes.join(14)
    for _ in range(3):
        assert_same(decodes.step(backends))


def test_the_own_tails_of_decodes_sharing_a_prefix_are_staged_too():
    """Decodes over 48 shared blocks attend to them once (a cascade); each one's tail is staged."""
    decodes = Decodes([200, 203, 207], seed=4, shared_blocks=48)
    staging, gathering = staging_backend(), TorchAttentionBackend()
    assert_same(decodes.step([staging, gathering]))
    [group] = staged_groups(staging)
    assert [table[0] for table in group.tables] != [decodes.shared[0]] * 3  # the tails, not whole tables
    for _ in range(5):
        assert_same(decodes.step([staging, gathering]))
        assert staged_groups(staging) == [group]


def test_a_member_replaced_on_the_same_first_block_is_gathered_afresh():
    """Decodes sharing a prefix block: one finishes and another, one position longer, takes its place."""
    decodes = Decodes([9, 10], seed=3)
    staging, gathering = staging_backend(), TorchAttentionBackend()
    assert_same(decodes.step([staging, gathering]))  # lens 9 and 10
    first_block = decodes.tables[0][0]
    decodes.leave(0)
    decodes.free.remove(first_block)
    decodes.tables.insert(0, [first_block, decodes.free.pop(), decodes.free.pop()])
    decodes.lens.insert(0, 9)  # 10 after the step: what the finished member would have had
    assert_same(decodes.step([staging, gathering]))


def test_a_layer_that_missed_a_step_gathers_again():
    """As after a step that failed half-way: one layer's buffers are a step behind the others."""
    decodes = Decodes([9, 10], seed=1)
    staging, gathering = staging_backend(), TorchAttentionBackend()
    assert_same(decodes.step([staging, gathering]))
    decodes.step([staging], attend_layers=range(1))  # layer 1's keys and values written, never attended
    assert_same(decodes.step([staging, gathering]))


def test_groups_beyond_the_budget_gather_every_step():
    decodes = Decodes([9, 10, 11], seed=2)
    staging, gathering = staging_backend(max_positions=8), TorchAttentionBackend()
    for _ in range(3):
        assert_same(decodes.step([staging, gathering]))
        assert staged_groups(staging) == []


def test_small_groups_gather_every_step():
    decodes = Decodes([9, 10, 11], seed=5)
    staging, gathering = staging_backend(min_group_positions=3 * 13), TorchAttentionBackend()
    assert_same(decodes.step([staging, gathering]))  # 3 x 11 positions
    assert staged_groups(staging) == []
    decodes.step([staging, gathering])
    assert_same(decodes.step([staging, gathering]))  # 3 x 13
    assert len(staged_groups(staging)) == 1


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="max_positions"):
        DecodeStaging(-1)
