"""Plain-torch references of the kernels: one token and one sequence at a time, in float32.

They are the oracle the Triton kernels and the fast torch path are tested against, so they trade all
speed for being obviously right.
"""

from __future__ import annotations

import torch


def reshape_and_cache_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]: block_id * block_size + offset
) -> None:
    """Write token `t`'s key and value into cache slot `slot_mapping[t]`."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[token]
        value_cache[block, offset] = value[token]


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], sequences packed back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of each sequence's queries over all of its keys, read from the cache.

    The queries of a sequence are its last `query_len` positions; query head `h` reads key/value
    head `h // (num_q_heads // num_kv_heads)`.
    """
    block_size = key_cache.shape[1]
    group_size = query.shape[1] // key_cache.shape[2]
    output = torch.empty_like(query)
    start = 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        positions = torch.arange(seq_len)
        blocks = torch.tensor(table[: -(-seq_len // block_size)])[positions // block_size]
        offsets = positions % block_size
        keys = key_cache[blocks, offsets].float().repeat_interleave(group_size, dim=1)  # [seq_len, num_q_heads, D]
        values = value_cache[blocks, offsets].float().repeat_interleave(group_size, dim=1)
        queries = query[start : start + query_len].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_positions = torch.arange(seq_len - query_len, seq_len)
        visible = positions[None, :] <= query_positions[:, None]  # [query_len, seq_len]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        output[start : start + query_len] = torch.einsum("hqk,khd->qhd", weights, values).to(query.dtype)
        start += query_len
    return output
