"""Linear layers with their weights laid out for CPU GEMMs, swapped in once the weights are loaded.

`F.linear(x, W)` multiplies by a transposed view of the `[out, in]` weight, and MKL repacks that
operand on every call. For the few rows of a decode step the repacking costs as much as the
arithmetic, and a whole model's weights do not stay in cache from one step to the next, so every
step would pay it again. The weights are laid out once instead, in up to two copies (`CpuLayout`):

- oneDNN's blocked layout, reordered once, for `mkldnn._linear_pointwise`;
- the weight stored transposed, `[in, out]` contiguous, for `torch.mm`;
- panels for the native few-row kernel (`few_row_linear.cpp`: float32, AVX-512), which streams the
  weights with software prefetches; where every weight of a matrix is exactly a GGUF Q4_1 or Q8_0
  block's d * q (+ m) (the embedded model's, dequantized), 4- or 8-bit blocks instead
  (`few_row_blocks.cpp`): the same bits out, a fifth or a quarter of the bytes to stream.

Which copy serves which row count follows where each was fastest over all of a model's projections,
weights not in cache, and over whole prefill and decode steps:

- where the native kernels run and memory allows two copies, the few-row copy serves 1 to `FEW_ROWS`
  rows, where it beats oneDNN's blocked kernel, and the transposed copy the rest, where it beats the
  blocked one: no blocked copy;
- otherwise float32 weights are kept blocked for steps of 2 rows or more, where the blocked layout
  wins, plus a transposed copy for single-row steps, where it loses, when memory allows (it doubles
  the projections' footprint); with one copy only, the blocked one for every row count, as it loses
  less where it loses. On a CPU where the transposed copy won the projections above 32 rows, whole
  steps barely differed, so one rule serves both;
- bfloat16 weights live only in the blocked layout, the fastest at every row count.

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
