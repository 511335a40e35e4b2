"""AttentionMetadata.build: slot mapping, packing and validation of one step's batch."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import AttentionMetadata


def test_build_maps_new_tokens_to_their_slots_and_packs_the_batch(device):
    # Sequence 0: 5 cached tokens + 3 new at positions 5..7, all in its second block (id 2) -> slots 9, 10, 11.
    # Sequence 1: a fresh 2-token prompt in block 3 -> slots 12, 13. Sequence 2: a decode at position 4,
    # the first slot of its second block (id 0) -> slot 0.
    meta = AttentionMetadata.build(
        query_lens=[3, 2, 1], seq_lens=[8, 2, 5], block_tables=[[7, 2], [3], [5, 0]], block_size=4, device=device
    )
    assert {meta.slot_mapping.device, meta.query_start_loc.device, meta.block_tables.device} == {device}
    assert meta.slot_mapping.tolist() == [9, 10, 11, 12, 13, 0]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6]
    assert meta.seq_lens.tolist() == [8, 2, 5]
    assert meta.block_tables.tolist() == [[7, 2], [3, 0], [5, 0]]
    assert meta.block_tables.dtype == meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert (meta.max_query_len, meta.num_seqs, meta.num_tokens) == (3, 3, 6)


def test_direct_construction_derives_the_host_lists():
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([9, 10, 0]),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([7, 5], dtype=torch.int32),
        block_tables=torch.tensor([[7, 2], [5, 0]], dtype=torch.int32),
        max_query_len=2,
    )
    assert meta.query_lens_list == [2, 1]
    assert meta.seq_lens_list == [7, 5]


@pytest.mark.parametrize(
    "query_lens,seq_lens,block_tables,block_size,field",
    [
        pytest.param([1], [1], [[0]], 0, "block_size", id="block-size"),
        pytest.param([1, 1], [1], [[0]], 4, "block_tables", id="lengths-disagree"),
        pytest.param([0], [3], [[0]], 4, r"query_lens\[0\]", id="empty-query"),
        pytest.param([4], [3], [[0]], 4, r"seq_lens\[0\]", id="query-longer-than-sequence"),
        pytest.param([1], [9], [[0, 1]], 4, r"block_tables\[0\]", id="too-few-blocks"),
        pytest.param([1], [2], [[-1]], 4, r"block_tables\[0\]", id="negative-block"),
    ],
)
def test_build_rejects_bad_batches_naming_the_field(query_lens, seq_lens, block_tables, block_size, field):
    with pytest.raises(ValueError, match=field):
        AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, "cpu")
