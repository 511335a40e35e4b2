"""The native few-row linear kernel against float64 `x @ W.T + b` (decode steps' projections).

Skipped only without AVX-512: on a machine that has it, a kernel that fails to build fails these.
"""
import pytest
import torch


pytestmark = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                reason="the native few-row linear kernel needs AVX-512")


def _reference(x, weight, bias):
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 33), (7, 576), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_row_count_matches_float64(kernels, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    packed = kernels.pack_few_row_weight(weight)
    for rows in [*range(0, 17), 31, 64, 128]:  # none: a step that samples nothing
        x = torch.randn(rows, in_features, generator=generator)
        out = kernels.few_row_linear(x, packed, out_features, bias)
        assert out.shape == (rows, out_features)
        torch.testing.assert_close(out.double(), _reference(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_others(kernels):
    """Row 0 alone, among 8 rows, and among 13 (a second pass of 5): the same bits."""
    weight = torch.randn(64, 48)
    packed = kernels.pack_few_row_weight(weight)
    x = torch.randn(13, 48)
    alone = kernels.few_row_linear(x[:1], packed, 64, None)
    for rows in (8, 13):
        assert torch.equal(kernels.few_row_linear(x[:rows], packed, 64, None)[:1], alone)
    assert torch.equal(kernels.few_row_linear(x, packed, 64, None)[8:9], kernels.few_row_linear(x[8:9], packed, 64, None))


def test_strided_rows(kernels):
    weight = torch.randn(40, 32)
    wide = torch.randn(5, 80)
    x = wide[:, :32]  # rows 80 floats apart
    out = kernels.few_row_linear(x, kernels.pack_few_row_weight(weight), 40, None)
    torch.testing.assert_close(out.double(), _reference(x, weight, None), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_not_read(kernels):
    weight = torch.randn(40, 32)
    packed = kernels.pack_few_row_weight(weight)
    with pytest.raises(RuntimeError, match="at most 128 rows"):
        kernels.few_row_linear(torch.randn(129, 32), packed, 40, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.few_row_linear(torch.randn(2, 31), packed, 40, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.few_row_linear(torch.randn(2, 32), packed, 80, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.few_row_linear(torch.randn(2, 32), packed, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="x:"):
        kernels.few_row_linear(torch.randn(2, 32, dtype=torch.float64), packed, 40, None)
