"""The Triton reshape_and_cache kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import AttentionMetadata, reshape_and_cache_reference


@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 24)])
def test_triton_kernel_writes_exactly_the_mapped_slots(triton_kernels, paged_batch, triton_device, num_kv_heads,
                                                       head_dim):
    from prefixcache.kernels.triton_ops.reshape_and_cache import reshape_and_cache

    batch = paged_batch([(0, 6), (9, 5), (12, 1), (3, 1)], block_size=4, num_kv_heads=num_kv_heads, queries_per_kv=1,
                        head_dim=head_dim, device=triton_device)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size,
                                   triton_device)
    expected_keys, expected_values = batch.key_cache.clone(), batch.value_cache.clone()
    reshape_and_cache_reference(batch.key, batch.value, expected_keys, expected_values, meta.slot_mapping)
    assert not torch.equal(expected_keys, batch.key_cache)

    reshape_and_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, meta.slot_mapping)
    assert torch.equal(batch.key_cache, expected_keys)  # every other slot untouched, too
    assert torch.equal(batch.value_cache, expected_values)


def test_triton_wrapper_rejects_mismatched_shapes(triton_kernels, triton_device):
    from prefixcache.kernels.triton_ops.reshape_and_cache import reshape_and_cache

    cache = torch.randn(4, 4, 2, 8, device=triton_device)
    key = torch.randn(3, 2, 8, device=triton_device)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, cache, cache.clone(), torch.arange(2, device=triton_device))
    with pytest.raises(ValueError, match="key_cache"):
        reshape_and_cache(key, key, torch.randn(4, 4, 3, 8, device=triton_device), cache,
                          torch.arange(3, device=triton_device))
