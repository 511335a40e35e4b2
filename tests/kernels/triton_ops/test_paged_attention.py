"""The Triton paged attention kernel against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import AttentionMetadata, get_attention_backend

# (queries per kv head, head_dim, block_size); two kv heads each. head_dim 24 exercises the kernel's padding.
SHAPES = [
    pytest.param(1, 16, 4, id="gqa1-d16-bs4"),
    pytest.param(3, 24, 8, id="gqa3-d24-bs8"),
]
# (cached context, new tokens) per sequence.
BATCHES = [
    pytest.param(
        [(0, 7), (9, 5), (12, 1), (5, 1), (0, 1), (3, 2)],
        id="mixed",  # fresh prefill, chunks on context, decodes (one opening a new block), a 1-token prompt
    ),
    pytest.param([(6, 1), (28, 1), (17, 1), (1, 1), (30, 1), (25, 1)], id="decodes"),  # some padded together
    pytest.param([(21, 19), (0, 18)], id="long-chunks"),  # several query tiles per sequence under GQA
]


@pytest.mark.parametrize("sequences", BATCHES)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_triton_kernel_matches_reference(
    triton_kernels, paged_batch, relative_error, sequences, queries_per_kv, head_dim, block_size
):
    from prefixcache.kernels.triton_ops.paged_attention import paged_attention

    batch = paged_batch(
        sequences, block_size=block_size, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=head_dim
    )
    meta = batch.write_new_kv()
    output = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        batch.scale,
    )
    assert relative_error(output.cpu(), batch.reference_attention()) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled Triton kernels at model size")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_backend_at_model_size_on_cuda(paged_batch, relative_error, device, dtype, tolerance):
    """SmolLM2's attention shape (9 query heads, 3 kv heads, head_dim 64), 16-token blocks, up to 1k context."""
    if device.type != "cuda":
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels are interpreted, too slow at model size")
    sequences = [(0, 300), (700, 324), (1023, 1), (511, 1), (64, 1), (250, 17)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64, dtype=dtype)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, device)
    backend = get_attention_backend(None, device)
    assert backend.name == "triton"
    backend.write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, meta)
    output = backend.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale)
    assert relative_error(output.cpu(), batch.reference_attention()) < tolerance
