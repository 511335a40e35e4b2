"""The Triton paged attention kernel, whole and split across the keys, against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from attention_batches import BATCHES, SHAPES

from prefixcache.kernels import AttentionMetadata, get_attention_backend
from prefixcache.kernels.triton_ops.split_kv import MAX_KV_SPLITS, MIN_KEYS_PER_SPLIT, kv_splits_for

# Split across the keys: contexts long and short in one batch, so that some splits of the short
# sequences see no key at all (tile_kv 16, the smallest a GPU's tl.dot takes, gives several per split).
SPLIT_BATCHES = [
    pytest.param([(150, 1), (3, 1), (70, 1), (0, 1), (97, 1)], id="decodes-long-and-short"),
    pytest.param([(120, 1), (0, 9), (40, 6), (2, 1)], id="mixed"),
    pytest.param([(100, 20)], id="chunk-on-long-context"),
]


def attend(batch, meta: AttentionMetadata, **options) -> torch.Tensor:
    from prefixcache.kernels.triton_ops.paged_attention import paged_attention

    return paged_attention(batch.query, batch.key_cache, batch.value_cache, meta.query_start_loc, meta.seq_lens,
                           meta.block_tables, meta.max_query_len, batch.scale, max(batch.seq_lens), **options)


@pytest.mark.parametrize("sequences", BATCHES)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_triton_kernel_matches_reference(
    triton_kernels, triton_device, paged_batch, relative_error, sequences, queries_per_kv, head_dim, block_size
):
    batch = paged_batch(sequences, block_size=block_size, num_kv_heads=2, queries_per_kv=queries_per_kv,
                        head_dim=head_dim, device=triton_device)
    meta = batch.write_new_kv()
    assert relative_error(attend(batch, meta), batch.reference_attention()) < 1e-5


@pytest.mark.parametrize("kv_splits", [2, 8])
@pytest.mark.parametrize("sequences", SPLIT_BATCHES)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_split_keys_merge_to_the_reference(
    triton_kernels, triton_device, paged_batch, relative_error, sequences, queries_per_kv, head_dim, block_size,
    kv_splits,
):
    batch = paged_batch(sequences, block_size=block_size, num_kv_heads=2, queries_per_kv=queries_per_kv,
                        head_dim=head_dim, device=triton_device)
    meta = batch.write_new_kv()
    split = attend(batch, meta, tile_kv=16, kv_splits=kv_splits)
    assert relative_error(split, batch.reference_attention()) < 1e-5
    assert relative_error(split, attend(batch, meta, tile_kv=16, kv_splits=1)) < 1e-6


def test_split_keys_never_read_blocks_outside_the_tables(triton_kernels, triton_device, paged_batch):
    """NaN in every cache slot past each sequence's length: a split that reads one shows it."""
    batch = paged_batch([(70, 1), (5, 1), (33, 4)], block_size=8, num_kv_heads=1, queries_per_kv=3, head_dim=16,
                        device=triton_device)
    meta = batch.write_new_kv()
    owned = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for seq_len, table in zip(batch.seq_lens, batch.block_tables):
        for position in range(seq_len):
            owned[table[position // batch.block_size], position % batch.block_size] = True
    expected = batch.reference_attention()
    batch.key_cache[~owned.to(triton_device)] = float("nan")
    batch.value_cache[~owned.to(triton_device)] = float("nan")
    output = attend(batch, meta, tile_kv=16, kv_splits=4)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_kv_splits_must_be_a_power_of_two(triton_kernels, triton_device, paged_batch):
    batch = paged_batch([(9, 1)], block_size=4, num_kv_heads=1, queries_per_kv=1, head_dim=16, device=triton_device)
    meta = batch.write_new_kv()
    with pytest.raises(ValueError, match="kv_splits must be a power of two, got 3"):
        attend(batch, meta, kv_splits=3)


@pytest.mark.parametrize(("num_programs", "max_seq_len", "num_sms", "splits"), [
    pytest.param(3, 8192, 132, MAX_KV_SPLITS, id="one-decode-8k"),  # 3 programs: as many splits as allowed
    pytest.param(3, 1024, 132, 4, id="one-decode-1k"),  # 1,024 keys hold four splits of 256
    pytest.param(3, 300, 132, 1, id="one-decode-short"),  # too short to split
    pytest.param(48, 4096, 132, 4, id="16-decodes-4k"),  # 48 programs: 4 splits give every SM one
    pytest.param(3 * 64, 8192, 132, 1, id="64-decodes"),  # the grid fills the GPU already
    pytest.param(3 * 16 * 4, 4096, 132, 1, id="long-prefill"),  # many query tiles
])
def test_splits_grow_with_context_and_shrink_with_the_batch(num_programs, max_seq_len, num_sms, splits):
    chosen = kv_splits_for(num_programs, max_seq_len, num_sms)
    assert chosen == splits
    assert chosen == 1 or max_seq_len // chosen >= MIN_KEYS_PER_SPLIT


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled Triton kernels at model size")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sequences", [
    pytest.param([(0, 300), (700, 324), (1023, 1), (511, 1), (64, 1), (250, 17)], id="mixed-1k"),
    pytest.param([(4095, 1), (2000, 1)], id="decodes-4k"),  # 6 programs over long contexts: split
])
def test_triton_backend_at_model_size_on_cuda(paged_batch, relative_error, triton_device, sequences, dtype,
                                              tolerance):
    """SmolLM2's attention shape (9 query heads, 3 kv heads, head_dim 64), 16-token blocks."""
    if triton_device.type != "cuda":
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels are interpreted, too slow at model size")
    from prefixcache.kernels.triton_ops.split_kv import choose_kv_splits

    if all(new == 1 for _, new in sequences):  # one query tile per sequence and kv head
        assert choose_kv_splits(len(sequences) * 3, max(c + 1 for c, _ in sequences), triton_device) > 1
    batch = paged_batch(sequences, block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64, dtype=dtype,
                        device=triton_device)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size,
                                   triton_device)
    backend = get_attention_backend(None, triton_device)
    assert backend.name == "triton"
    backend.write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, meta)
    output = backend.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale)
    assert relative_error(output, batch.reference_attention()) < tolerance
