"""How `TorchAttentionPlan` splits a step: decode groups by length, cascades where they save enough."""

from __future__ import annotations

import functools

import pytest

from prefixcache.kernels import AttentionMetadata
from prefixcache.kernels.cpu.attention_plan import TorchAttentionPlan


@pytest.fixture
def paged_batch(paged_batch):
    """Batches on the CPU: cascades are planned there only (see `attention_plan`)."""
    return functools.partial(paged_batch, device="cpu")


def test_torch_path_groups_decodes_of_similar_length(paged_batch):
    """Decodes of 31, 29 and 26 positions share one padded SDPA call; 4,000 and 2 positions get their own."""
    sequences = [(30, 1), (3999, 1), (28, 1), (1, 1), (25, 1)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=1, queries_per_kv=1, head_dim=8)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, "cpu")
    plan = TorchAttentionPlan.build(meta, batch.block_size)
    shapes = sorted((decodes.blocks.shape[0], decodes.max_len) for decodes in plan.decode_batches)
    assert shapes == [(1, 2), (1, 4000), (3, 31)]
    [padded] = [decodes for decodes in plan.decode_batches if decodes.visible is not None]
    assert padded.visible.sum(dim=-1).flatten().tolist() == [31, 29, 26]


def test_torch_path_skips_a_cascade_that_would_save_little(paged_batch):
    """Two decodes sharing 4 blocks of 16 would save reading 64 positions: not worth a cascade."""
    batch = paged_batch([(80, 1), (90, 1)], block_size=16, num_kv_heads=1, queries_per_kv=1, head_dim=8)
    batch.block_tables[1][:4] = batch.block_tables[0][:4]
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, "cpu")
    plan = TorchAttentionPlan.build(meta, batch.block_size)
    assert plan.cascades == [] and sum(d.blocks.shape[0] for d in plan.decode_batches) == 2


@pytest.mark.parametrize("shared_blocks,cascaded", [(64, False), (74, True)])
def test_beside_the_native_decode_kernel_only_large_shared_prefixes_cascade(shared_blocks, cascaded):
    """8 decodes sharing 64 blocks save 7 x 1,024 re-read positions, under the 8,192 a cascade needs
    there; sharing 74 blocks saves 8,288. The torch path alone cascades both (256)."""
    shared = list(range(shared_blocks))
    tables = [shared + [shared_blocks + i] for i in range(8)]
    seq_len = shared_blocks * 16 + 5
    meta = AttentionMetadata.build([1] * 8, [seq_len] * 8, tables, 16, "cpu")
    native_plan = TorchAttentionPlan.build(meta, 16, native=True)
    assert bool(native_plan.cascades) == cascaded
    assert (native_plan.native_decodes is None) == cascaded
    assert len(TorchAttentionPlan.build(meta, 16).cascades) == 1
