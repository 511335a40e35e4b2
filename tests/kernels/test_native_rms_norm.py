"""The native residual add + RMSNorm (`kernels/cpu/rms_norm.cpp`) against the model's torch RMSNorm."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels.native_cpu import native_cpu_kernels
from prefixcache.services.worker.models.llama import RMSNorm

pytestmark = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                reason="the native kernels need AVX-512")


@pytest.fixture(scope="module")
def kernels():
    built = native_cpu_kernels()
    assert built is not None, "the native kernels did not build on a CPU that runs them (see the log)"
    return built


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
