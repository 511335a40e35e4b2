"""CpuLinear computes what nn.Linear computes, from whichever weight layout serves the row count."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.kernels.cpu.linear import (
    ALL_ROWS,
    FEW_ROWS,
    FLOAT32_BLOCKED_ROWS,
    CpuLayout,
    CpuLinear,
    choose_layout,
    swap_in_cpu_linears,
)
from prefixcache.kernels.cpu.native import NativeCpuKernels, native_cpu_kernels

ROW_COUNTS = (1, 2, 7, 8, 16, 17, 32, 33, 100, 128, 129, 200)
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _weights(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=generator) * 0.1).to(dtype)
    return weight, (torch.randn(96, generator=generator).to(dtype) if bias else None)


def _layouts() -> list:
    layouts = [CpuLayout(None), CpuLayout(FLOAT32_BLOCKED_ROWS), CpuLayout(ALL_ROWS)]
    native = native_cpu_kernels()
    if native is not None:
        layouts.append(CpuLayout(None, native))
    return [pytest.param(layout, id=f"blocked={layout.blocked_rows}-few={layout.few_rows is not None}")
            for layout in layouts]


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", _layouts())
def test_float32_matches_linear_for_every_row_count(bias: bool, layout: CpuLayout) -> None:
    weight, bias_tensor = _weights(torch.float32, bias)
    layer = CpuLinear(weight, bias_tensor, layout)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias_tensor), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.skipif(torch.backends.mkldnn.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU has no oneDNN bfloat16 support")
def test_bfloat16_blocked_for_all_rows_matches_linear() -> None:
    weight, bias = _weights(torch.bfloat16, True)
    layer = CpuLinear(weight, bias, CpuLayout(ALL_ROWS))
    assert layer.weight_t is None and layer.weight_packed is None  # the blocked copy is the only one
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
        torch.testing.assert_close(layer(x).float(), F.linear(x, weight, bias).float(), rtol=2e-2, atol=2e-2)


def test_transposed_copy_only_without_blocked_rows() -> None:
    weight, _ = _weights(torch.float32, False)
    layer = CpuLinear(weight, None, CpuLayout(None))
    assert layer.weight_blocked is None and layer.weight_packed is None
    assert layer.weight_t.shape == (64, 96) and layer.weight_t.is_contiguous()
    assert torch.equal(layer.weight_t, weight.t())


@needs_onednn
def test_layout_depends_on_dtype_memory_and_the_native_kernels() -> None:
    free = 1 << 30
    assert choose_layout(torch.float32, 1 << 20, free) == CpuLayout(FLOAT32_BLOCKED_ROWS)
    assert choose_layout(torch.float32, free, free) == CpuLayout(ALL_ROWS)  # no room for a second copy: blocked only
    assert choose_layout(torch.float32, 1 << 20, None) == CpuLayout(ALL_ROWS)  # free memory unknown: one copy
    expected_bf16 = ALL_ROWS if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    assert choose_layout(torch.bfloat16, 1 << 20, free) == CpuLayout(expected_bf16)  # one copy, whatever the size
    native = native_cpu_kernels()
    if native is not None:
        assert choose_layout(torch.float32, 1 << 20, free, native) == CpuLayout(None, native)
        assert choose_layout(torch.float32, free, free, native) == CpuLayout(ALL_ROWS)


needs_avx512 = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                  reason="the native few-row linear kernel needs AVX-512")


def _native() -> NativeCpuKernels:
    native = native_cpu_kernels()
    assert native is not None, "the native kernels did not build on a CPU that runs them (see the log)"
    return native


@needs_avx512
def test_with_the_few_row_kernel_the_copies_are_packed_and_transposed() -> None:
    weight, _ = _weights(torch.float32, False)
    layer = CpuLinear(weight, None, CpuLayout(None, _native()))
    assert layer.weight_blocked is None and layer.weight_packed.dtype == torch.float32  # no exact 4-bit form
    assert torch.equal(layer.weight_t, weight.t())


@needs_avx512
def test_weights_on_a_4bit_grid_stream_as_blocks_with_the_same_results() -> None:
    """A weight whose 32-wide runs are each q * d + m (a dequantized GGUF Q4_1 tensor) is packed as
    4-bit blocks; the layer's outputs keep the bits of the float32 panels."""
    native = _native()
    generator = torch.Generator().manual_seed(5)
    scale = torch.rand(96, 2, 1, generator=generator).half().float() / 8
    low = -torch.rand(96, 2, 1, generator=generator).half().float()
    levels = torch.randint(0, 16, (96, 2, 32), generator=generator).float()
    levels[..., 3], levels[..., 20] = 0, 15  # as GGUF's quantizer makes them: the least and the greatest
    weight = torch.addcmul(low, levels, scale).reshape(96, 64)  # levels * scale is exact: one rounding
    bias = torch.randn(96, generator=generator)
    layer = CpuLinear(weight, bias, CpuLayout(None, native))
    assert layer.weight_packed.dtype == torch.uint8 and "blocks" in repr(layer)
    panels = native.pack_few_row_weight(weight)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 64, generator=generator)
        expected = native.few_row_linear(x, panels, 96, bias) if rows <= FEW_ROWS else torch.addmm(bias, x, weight.t())
        assert torch.equal(layer(x), expected), rows


def test_swap_replaces_every_linear_and_keeps_the_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16, bias=False)))
    x = torch.randn(5, 64)
    expected = model(x)
    assert swap_in_cpu_linears(model, CpuLayout(None)) == 2
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    torch.testing.assert_close(model(x), expected)
