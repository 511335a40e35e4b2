"""Triton kernel: write this step's new keys and values into their paged KV cache slots.

Reference: `reference.reshape_and_cache_reference`. On CPU this module only runs under Triton's
interpreter, and `TRITON_INTERPRET=1` must be set before it is imported (`@triton.jit` reads it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,  # key and value caches share one layout (checked by the host wrapper)
    stride_cache_slot,
    stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,  # the next powers of two, since tl.arange needs one
    HEAD_DIM_PAD: tl.constexpr,
):
    # One program copies one token: all of its heads, keys and values.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, NUM_KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    cache_offsets = block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head + dims

    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[t]`/`value[t]` into slot `slot_mapping[t]` of `key_cache`/`value_cache`, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
            "must agree on the number of tokens"
        )
    if (
        key_cache.shape[2:] != (num_kv_heads, head_dim)
        or value_cache.shape != key_cache.shape
        or value_cache.stride() != key_cache.stride()
    ):
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache must share one layout ending in "
            f"({num_kv_heads}, {head_dim})"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("key, value and the caches must be contiguous in head_dim")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
