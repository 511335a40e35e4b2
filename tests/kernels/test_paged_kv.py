"""The paged KV cache's shape, allocation and sizing helpers."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import allocate_kv_cache, kv_cache_bytes_per_block, kv_cache_shape, num_blocks_for_budget


def test_kv_cache_shape_and_allocation(device):
    assert kv_cache_shape(10, 16, 3, 64) == (10, 16, 3, 64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_shape(10, 16, 0, 64)
    layers = allocate_kv_cache(2, 10, 16, 3, 64, torch.bfloat16, device)
    assert len(layers) == 2
    for key_cache, value_cache in layers:
        assert key_cache.shape == value_cache.shape == (10, 16, 3, 64)
        assert key_cache.dtype == torch.bfloat16 and key_cache.device == device
        assert key_cache.data_ptr() != value_cache.data_ptr()
        assert not key_cache.any()  # zeros: no slot can hold NaN


def test_num_blocks_for_budget():
    # SmolLM2: 30 layers x 16 slots x 3 kv heads x 64 dims x 4 bytes, keys and values.
    per_block = kv_cache_bytes_per_block(30, 16, 3, 64, torch.float32)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert num_blocks_for_budget(10 * per_block + per_block - 1, 30, 16, 3, 64, torch.float32) == 10
    with pytest.raises(ValueError, match="below one block"):
        num_blocks_for_budget(per_block - 1, 30, 16, 3, 64, torch.float32)
