"""The paged KV cache layout: per layer, one key and one value tensor of fixed-size blocks."""

from __future__ import annotations

import torch


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of one layer's key (or value) cache: `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return (num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, keys and values together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_budget(
    memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many blocks fit in `memory_bytes`; a ValueError when not even one does."""
    per_block = kv_cache_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    num_blocks = memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv cache memory budget of {memory_bytes} bytes is below one block ({per_block} bytes)")
    return num_blocks


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zero-filled `(key_cache, value_cache)` pair per layer.

    Zeros rather than uninitialised memory: no slot ever holds NaN, so a masked-out slot read by a
    padded gather cannot poison a softmax-weighted sum (0 * NaN is NaN).
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
