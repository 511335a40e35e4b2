"""Linear layers with their weights laid out for CPU GEMMs, swapped in once the weights are loaded.

`F.linear(x, W)` multiplies by a transposed view of the `[out, in]` weight, and MKL repacks that
operand on every call. For the few rows of a decode step the repacking costs as much as the
arithmetic, and a whole model's weights do not stay in cache from one step to the next, so every
step pays it again. Two layouts avoid it:

- the weight stored transposed, `[in, out]` contiguous, for `torch.mm`;
- oneDNN's blocked layout, reordered once, for `mkldnn._linear_pointwise`.

Measured on the 2-core dev VM, SmolLM2-135M's 30 layers, weights not in cache, ms per step for all
projections (F.linear / transposed / blocked), 2026-12-02/03:

    float32   1 row 24.5 / 21.7 / 28.5   8 rows 55.3 / 45.0 / 36.3   64 rows 96.5 / 87.7 / 120.1
    bfloat16  1 row 27.7 / 32.0 / 20.1   8 rows 38.2 / 41.2 / 29.1   256 rows 410 / 408 / 387

and the tied 49,152-row logits head, float32, 8 rows: 18.8 / 11.6 / 7.8. The same CPU model in a
slower phase (2026-12-04, transposed / blocked) gave 1 row 34.1 / 27.0, 2 rows 79.2 / 49.7, 4 rows
107 / 56, 58 rows 145 / 120, 200 rows 437 / 366, 1,050 rows 2,180 / 1,769 (and the whole model's
batch-1 decode step 51 / 62 ms). Where the blocked layout lost, it took about a third longer (1 row
and 64 rows, 2026-12-03); where the transposed one lost, a fifth to nine tenths longer (2 rows and
up, 2026-12-04). So float32 weights are kept blocked for steps of 2 rows or more, plus a transposed
copy for single-row steps when memory allows (it doubles the projections' footprint); bfloat16
weights live only in the blocked layout.
On an Intel Xeon VM with AVX-512 (2026-12-04 night) the projections alone favoured the transposed
copy above 32 rows (64 rows 70.7 / 85.2, 1,050 rows 714 / 894), yet the whole model, blocked for
2-32 rows against 2 rows and up, differed by 2% at most (prefill 1,024 tokens 1,089 / 1,108 ms,
decode batch 64 160 / 161 ms a step), so one rule serves both CPUs.
The native few-row kernel (`kernels/prefixcache/kernels/cpu/few_row_linear.cpp`, float32, AVX-512) streams a third
layout, panels of 32 output columns, with software prefetches. On the Intel Xeon VM (2026-12-05), all
projections of the 30 layers, weights not in cache, ms (oneDNN blocked / few-row): 1 row 21.5 / 15.9,
2 rows 21.9 / 17.2, 4 rows 22.0 / 18.9, 8 rows 25.7 / 20.9, 16 rows 31.9 / 26.6, 64 rows 71.3 / 59.0,
128 rows 110 / 101, 192 rows 150 / 143, 256 rows 189 / 188 (the transposed copy, 1 row: 15.1).
Where it runs, it serves 1 to 128 rows and the transposed copy the rest: on that VM (2026-12-05) the
whole model's prefill took, ms, transposed / blocked above 128 rows: 160 tokens 176 / 197, 300 tokens
323 / 335, 1,074 tokens 1,147 / 1,171, 2,048 tokens 2,502 / 2,573 (medians of six, interleaved); and
the projections alone, 160 rows, 146 / 155-166. So no blocked copy is made there.
Where every weight of a matrix is exactly a GGUF Q4_1 or Q8_0 block's d * q (+ m) (the embedded
model's, dequantized), the few-row copy holds those 4- or 8-bit blocks instead of float32 panels
(`kernels/prefixcache/kernels/cpu/few_row_blocks.cpp`): the same bits out, a fifth (a quarter) of the bytes to stream. On
the Intel Xeon VM (2026-12-05, later), all projections of the 30 layers, weights not in cache, ms
(float32 panels / blocks, `benchmarks/few_row_linear.py`): 1 row 17.9 / 4.5, 8 rows 24.9 / 8.2, 64
rows 69.1 / 55.7, 128 rows 120 / 118; the tied logits head, 8 rows, 6.0 / 2.1.
The choice is fixed, not timed at start-up: the layouts' float32 results differ by up to 1e-4,
and workers of one deployment must agree on greedy tokens.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from prefixcache.kernels.cpu.native import NativeCpuKernels

FLOAT32_BLOCKED_ROWS = range(2, sys.maxsize)
ALL_ROWS = range(0, sys.maxsize)
FEW_ROWS = 128  # the most rows the native few-row kernel takes
_BLOCKED_HINT_ROWS = 8  # the row count oneDNN tunes its reorder for
# float32 weights get a second copy (packed for the few-row kernel, else transposed for single-row
# steps) while all projections' weights take at most this share of the memory available after
# loading; otherwise the blocked copy alone.
_TWO_COPIES_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class CpuLayout:
    """Which copy of each weight serves which row count: with `few_rows` (the native kernels), 1 to
    FEW_ROWS rows use a packed copy; `blocked_rows` use oneDNN's blocked copy (None: none made);
    any other row count uses a transposed copy, made only if some row count needs it."""

    blocked_rows: range | None
    few_rows: NativeCpuKernels | None = None


def choose_layout(
    dtype: torch.dtype, projection_bytes: int, free_memory_bytes: int | None, native: NativeCpuKernels | None = None,
) -> CpuLayout:
    """The layout for these weights, given the memory free after loading (None: unknown, so one
    copy only); `native`: the native kernels, for float32 weights where they run."""
    if dtype == torch.bfloat16:
        return CpuLayout(ALL_ROWS if _blocked_layout_works(dtype) else None)
    if dtype != torch.float32:
        return CpuLayout(None)
    two_copies = free_memory_bytes is not None and projection_bytes <= _TWO_COPIES_MEMORY_SHARE * free_memory_bytes
    if two_copies and native is not None:
        return CpuLayout(None, native)
    if not _blocked_layout_works(dtype):
        return CpuLayout(None)
    # With one copy only, the blocked one loses less where it loses (module docstring).
    return CpuLayout(FLOAT32_BLOCKED_ROWS if two_copies else ALL_ROWS)


@lru_cache(maxsize=None)
def _blocked_layout_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can reorder and multiply `dtype` weights with oneDNN."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        weight = torch.ones(4, 4, dtype=dtype)
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, _BLOCKED_HINT_ROWS)
        product = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=dtype), blocked, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((product == 4).all())


class CpuLinear(nn.Module):
    """`y = x @ weight.T + bias` for 2-D `x`, from weights laid out for the CPU (see module docstring
    and `CpuLayout`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: CpuLayout) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.blocked_rows = layout.blocked_rows or range(0)
        self.few_rows = layout.few_rows
        first_other_row = FEW_ROWS + 1 if self.few_rows is not None else 1
        needs_transposed = not (self.blocked_rows.start <= first_other_row and self.blocked_rows.stop == sys.maxsize)
        packed = self._pack_few_rows(weight) if self.few_rows is not None else None
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, _BLOCKED_HINT_ROWS) if self.blocked_rows else None
        self.register_buffer("weight_t", weight.t().contiguous() if needs_transposed else None)
        self.register_buffer("weight_blocked", blocked)
        self.register_buffer("weight_packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _pack_few_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """Exact 4- or 8-bit blocks where they reproduce every weight (a GGUF's Q4_1 or Q8_0 tensors,
        dequantized), else float32 panels: the same bits either way, a fifth or a quarter of the bytes."""
        blocks = self.few_rows.pack_few_row_blocks(weight)
        return blocks if blocks is not None else self.few_rows.pack_few_row_weight(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.few_rows is not None and rows <= FEW_ROWS:
            return self.few_rows.few_row_linear(x.contiguous(), self.weight_packed, self.out_features, self.bias)
        if rows in self.blocked_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_blocked, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def extra_repr(self) -> str:
        rows = self.blocked_rows
        blocked = "none" if not rows else "all" if rows == ALL_ROWS else \
            f"{rows.start}+" if rows.stop == sys.maxsize else f"{rows.start}-{rows.stop - 1}"
        few = "" if self.few_rows is None else \
            f", few_rows=1-{FEW_ROWS} ({'blocks' if self.weight_packed.dtype == torch.uint8 else 'float32'})"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, blocked_rows={blocked}{few}")


def swap_in_cpu_linears(model: nn.Module, layout: CpuLayout) -> int:
    """Replace every `nn.Linear` in `model` by a `CpuLinear` holding the same weights; returns the count.

    The original weights are dropped with the replaced modules, so this runs once, after loading.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, CpuLinear(child.weight, child.bias, layout))
                replaced += 1
    return replaced
