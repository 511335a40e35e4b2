"""The native few-row linear kernel against float64 `x @ W.T + b` (decode steps' projections), and
its 4-/8-bit block form against its float32 panels, bit for bit.

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


def _gguf_weight(quant_type: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A weight as the GGUF converter makes it: float32 values quantized by gguf into `quant_type`
    blocks, then dequantized."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[quant_type]
    values = np.random.default_rng(seed).standard_normal((out_features, in_features), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind),
                                                 dtype=np.float32))


@pytest.mark.parametrize("quant_type,block_bytes", [("Q4_1", 640), ("Q8_0", 1088)])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 576), (7, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gguf_blocks_give_the_float32_panels_bits(kernels, quant_type, block_bytes, out_features, in_features,
                                                  with_bias):
    """Dequantized Q4_1 (4-bit) and Q8_0 (8-bit) weights pack as blocks, and every row count gets the
    very bits the float32 panels give."""
    weight = _gguf_weight(quant_type, out_features, in_features, seed=out_features)
    blocks = kernels.pack_few_row_blocks(weight)
    assert blocks is not None and blocks.dtype == torch.uint8
    assert blocks.shape == (-(-out_features // 32), in_features // 32, block_bytes)
    panels = kernels.pack_few_row_weight(weight)
    generator = torch.Generator().manual_seed(in_features)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    for rows in [*range(0, 17), 31, 64, 128]:
        x = torch.randn(rows, in_features, generator=generator)
        assert torch.equal(kernels.few_row_linear(x, blocks, out_features, bias),
                           kernels.few_row_linear(x, panels, out_features, bias)), rows


def test_blocks_take_strided_rows(kernels):
    weight = _gguf_weight("Q4_1", 40, 64, seed=3)
    x = torch.randn(5, 100)[:, :64]
    assert torch.equal(kernels.few_row_linear(x, kernels.pack_few_row_blocks(weight), 40, None),
                       kernels.few_row_linear(x, kernels.pack_few_row_weight(weight), 40, None))


@pytest.mark.parametrize("quant_type", ["Q4_1", "Q8_0"])
def test_weights_without_an_exact_block_form_are_not_packed_as_blocks(kernels, quant_type):
    weight = _gguf_weight(quant_type, 64, 64, seed=1)
    assert kernels.pack_few_row_blocks(weight) is not None
    one_ulp_off = weight.clone()
    one_ulp_off[37, 50] = torch.nextafter(one_ulp_off[37, 50], torch.tensor(10.0))
    assert kernels.pack_few_row_blocks(one_ulp_off) is None
    assert kernels.pack_few_row_blocks(weight[:, :48].contiguous()) is None  # in_features not a multiple of 32


def test_plain_float32_and_negative_zero_are_not_packed_as_blocks(kernels):
    assert kernels.pack_few_row_blocks(torch.randn(64, 64)) is None
    negative_zero = torch.zeros(32, 32)
    negative_zero[3, 4] = -0.0
    assert kernels.pack_few_row_blocks(negative_zero) is None  # q * d + m would give +0.0
    assert kernels.pack_few_row_blocks(torch.zeros(32, 32)) is not None
