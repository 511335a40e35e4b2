"""Backend selection and the KV cache allocation helpers."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import (
    allocate_kv_cache,
    get_attention_backend,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    num_blocks_for_budget,
)


@pytest.mark.parametrize("name", [None, "auto"])
def test_auto_picks_torch_on_cpu(name):
    assert get_attention_backend(name, "cpu").name == "torch"


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_named_backends_are_honoured_on_cpu(name):
    assert get_attention_backend(name, torch.device("cpu")).name == name


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch"):
        get_attention_backend("flash")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")


def test_triton_backend_where_triton_runs(triton_kernels, device):
    assert get_attention_backend("triton", device).name == "triton"


def test_interpreted_triton_refuses_bfloat16(triton_kernels, device):
    """Triton's interpreter gets bfloat16 dot products wrong by orders of magnitude: say so instead."""
    if device.type == "cuda":
        pytest.skip("compiled kernels run bfloat16 correctly")
    assert get_attention_backend("triton", device, dtype=torch.float32).name == "triton"
    with pytest.raises(ValueError, match="interpreter computes bfloat16 dot products wrongly"):
        get_attention_backend("triton", device, dtype=torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when no CUDA device exists")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        get_attention_backend(None, "cuda")


def test_kv_cache_shape_and_allocation():
    assert kv_cache_shape(10, 16, 3, 64) == (10, 16, 3, 64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_shape(10, 16, 0, 64)
    layers = allocate_kv_cache(2, 10, 16, 3, 64, torch.bfloat16, "cpu")
    assert len(layers) == 2
    for key_cache, value_cache in layers:
        assert key_cache.shape == value_cache.shape == (10, 16, 3, 64)
        assert key_cache.dtype == torch.bfloat16
        assert key_cache.data_ptr() != value_cache.data_ptr()
        assert not key_cache.any()  # zeros: no slot can hold NaN


def test_num_blocks_for_budget():
    # SmolLM2: 30 layers x 16 slots x 3 kv heads x 64 dims x 4 bytes, keys and values.
    per_block = kv_cache_bytes_per_block(30, 16, 3, 64, torch.float32)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert num_blocks_for_budget(10 * per_block + per_block - 1, 30, 16, 3, 64, torch.float32) == 10
    with pytest.raises(ValueError, match="below one block"):
        num_blocks_for_budget(per_block - 1, 30, 16, 3, 64, torch.float32)
