"""Shared by the kernel benchmarks: one layer's attention inputs at SmolLM2's shape, over a shuffled paged cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixcache.kernels import AttentionMetadata, allocate_kv_cache

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


@dataclass(frozen=True)
class Case:
    name: str
    sequences: list[tuple[int, int]]  # (cached context, new tokens); all alike, so a dense baseline exists


CASES = [
    Case("prefill 1024", [(0, 1024)]),
    Case("prefill 50 on 1000 cached", [(1000, 50)]),
    Case("prefill 125 on 992 cached", [(992, 125)]),
    Case("decode x1 at 1k", [(1023, 1)]),
    Case("decode x16 at 1k", [(1023, 1)] * 16),
]


@dataclass
class LayerInputs:
    meta: AttentionMetadata
    query: torch.Tensor  # [num_tokens, NUM_Q_HEADS, HEAD_DIM]
    key: torch.Tensor  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM], random
    value_cache: torch.Tensor
    scale: float = HEAD_DIM**-0.5


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> LayerInputs:
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [context + new for context, new in case.sequences]
    blocks_needed = [-(-seq_len // BLOCK_SIZE) for seq_len in seq_lens]
    pool = torch.randperm(sum(blocks_needed), generator=generator).tolist()
    tables = []
    for count in blocks_needed:
        tables.append(pool[:count])
        pool = pool[count:]
    meta = AttentionMetadata.build([new for _, new in case.sequences], seq_lens, tables, BLOCK_SIZE, device)
    [(key_cache, value_cache)] = allocate_kv_cache(
        1, sum(blocks_needed), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, device
    )

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    key_cache.copy_(random(*key_cache.shape))
    value_cache.copy_(random(*value_cache.shape))
    return LayerInputs(
        meta=meta,
        query=random(meta.num_tokens, NUM_Q_HEADS, HEAD_DIM),
        key=random(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM),
        value=random(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM),
        key_cache=key_cache,
        value_cache=value_cache,
    )


def dense_sdpa(case: Case, dtype: torch.dtype, device: torch.device | str) -> Callable[[], torch.Tensor]:
    """The unpaged lower bound: SDPA over contiguous `[batch, heads, len, dim]` tensors of the same sizes."""
    context, new = case.sequences[0]
    batch, seq_len = len(case.sequences), context + new
    query = torch.randn(batch, NUM_Q_HEADS, new, HEAD_DIM, dtype=dtype, device=device)
    key = torch.randn(batch, NUM_KV_HEADS, seq_len, HEAD_DIM, dtype=dtype, device=device)
    value = torch.randn_like(key)
    mask = None
    if context and new > 1:
        positions = torch.arange(seq_len, device=device)
        mask = positions[None, :] <= positions[context:, None]
    return lambda: F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=context == 0 and new > 1, enable_gqa=True
    )


def median_ms(function: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of `function` in milliseconds (synchronising CUDA around each call)."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        function()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for line in [header, ["-" * width for width in widths], *rows]:
        cells = [line[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(line[1:], widths[1:])]
        print("  ".join(cells))
