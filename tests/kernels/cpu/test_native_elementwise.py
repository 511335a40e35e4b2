"""The native elementwise kernels (`cpu/rms_norm.cpp`, `cpu/elementwise.cpp`) against the model's torch code."""

from __future__ import annotations

import pytest
import torch

from prefixcache.worker.model_config import RopeConfig
from prefixcache.worker.models.llama import RMSNorm
from prefixcache.worker.models.rotary import RotaryEmbedding, rotate

pytestmark = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                reason="the native kernels need AVX-512")


def torch_norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(seed)))
    return norm


def inputs(rows: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, size, generator=generator) * 3, torch.randn(rows, size, generator=generator)


# 576: SmolLM2's hidden size (36 vectors); 100 leaves a tail of 4 past the last whole vector.
@pytest.mark.parametrize("rows,size", [(1, 576), (37, 576), (5, 100), (2, 7)])
def test_norm_matches_torch(kernels, relative_error, rows, size):
    norm = torch_norm(size, 0)
    hidden, _ = inputs(rows, size, 1)
    expected = norm(hidden)
    out = kernels.rms_norm(hidden, norm.weight, norm.eps)
    assert out.data_ptr() != hidden.data_ptr()
    assert relative_error(out, expected) < 1e-6


@pytest.mark.parametrize("rows,size", [(1, 576), (40, 576), (3, 100)])
def test_residual_add_then_norm(kernels, relative_error, rows, size):
    norm = torch_norm(size, 2)
    hidden, residual = inputs(rows, size, 3)
    expected_sum = hidden + residual
    expected = norm(expected_sum)
    out = kernels.add_rms_norm_(hidden, residual, norm.weight, norm.eps)
    assert torch.equal(residual, expected_sum)  # the running residual holds the exact sum
    assert out.data_ptr() == hidden.data_ptr()  # the norm lands over the sublayer's output
    assert relative_error(out, expected) < 1e-6


def test_a_row_does_not_depend_on_the_batch(kernels):
    """A decode's row and the same row inside a prefill's batch normalise to the same bits."""
    norm = torch_norm(576, 4)
    hidden, _ = inputs(50, 576, 5)
    whole = kernels.rms_norm(hidden, norm.weight, norm.eps)
    assert torch.equal(kernels.rms_norm(hidden[17:18].clone(), norm.weight, norm.eps), whole[17:18])


def test_the_model_norm_uses_the_kernel_only_when_it_can(kernels, relative_error):
    norm = torch_norm(576, 6)
    hidden, residual = inputs(8, 576, 7)
    expected = norm(hidden + residual)
    norm.native = kernels
    assert relative_error(norm.add_residual(hidden.clone(), residual.clone()), expected) < 1e-6
    strided = torch.cat([hidden, hidden], dim=1)[:, :576]  # not contiguous: the torch path serves it
    assert torch.equal(norm(strided), torch_norm(576, 6)(strided))


@pytest.mark.parametrize("rows,intermediate", [(1, 1536), (9, 1536), (3, 40)])
def test_silu_and_mul_matches_torch(kernels, relative_error, rows, intermediate):
    gate_up = torch.randn(rows, 2 * intermediate, generator=torch.Generator().manual_seed(8)) * 4
    gate, up = gate_up.split(intermediate, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = kernels.silu_and_mul(gate_up)
    assert out.is_contiguous() and out.shape == (rows, intermediate)
    assert relative_error(out, expected) < 1e-6



def test_silu_and_mul_at_extreme_gates(kernels):
    """e^-gate overflows or underflows here: the result stays finite and right, never NaN."""
    gate = torch.tensor([[-200.0, -104.0, -90.0, -20.0, 20.0, 90.0, 104.0, 200.0] * 2])
    out = kernels.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.nn.functional.silu(gate), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotation_is_torchs_to_the_bit(kernels, head_dim):
    """In place on a strided view of the fused projection, as the model calls it."""
    rotary = RotaryEmbedding(RopeConfig(theta=100000.0), head_dim, 4096)
    positions = torch.tensor([0, 1, 17, 900, 4095, 33])
    cos, signed_sin = rotary.for_positions(positions, torch.float32)
    qkv = torch.randn(6, (9 + 3 + 3) * head_dim, generator=torch.Generator().manual_seed(9))
    query_key = qkv[:, : 12 * head_dim].view(6, 12, head_dim)
    expected = rotate(query_key, (cos, signed_sin))
    values_before = qkv[:, 12 * head_dim :].clone()
    rotated = kernels.rotate_(query_key, cos, signed_sin)
    assert rotated.data_ptr() == qkv.data_ptr()
    assert torch.equal(rotated, expected)
    assert torch.equal(qkv[:, 12 * head_dim :], values_before)  # the values beside them are untouched
