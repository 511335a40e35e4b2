"""Triton kernel: paged attention over a packed batch of prefill chunks and decodes.

Each program takes a tile of one sequence's query tokens, for all the query heads that share one
key/value head (GQA), and streams that sequence's keys and values out of the paged cache with an
online softmax (as in the Triton fused-attention tutorial). Keys are addressed per position through
the block table, so any block size and any block order work. A query at absolute position `p` sees
keys `0..p`: its sequence's cached context and, causally, this step's own tokens, which the caller
has already written to the cache.

When the grid is too small to occupy the GPU (a few decodes over long contexts), the keys of each
tile are split into `kv_splits` consecutive ranges, one program each; every program then writes its
unnormalised partial output with its running max and sum, and `split_kv.merge_kv_splits` combines
them (see `split_kv` for the merge and for how many splits a batch gets).

Reference: `reference.paged_attention_reference`. On CPU this module only runs under Triton's
interpreter, and `TRITON_INTERPRET=1` must be set before it is imported (`@triton.jit` reads it).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from prefixcache.kernels.triton_ops.split_kv import PartialResults, choose_kv_splits, merge_kv_splits


@triton.jit
def _paged_attention_kernel(
    output_ptr,  # [num_tokens, num_q_heads, head_dim]; with KV_SPLITS > 1, unused (the merge writes it)
    partial_output_ptr,  # [num_tokens, num_q_heads, KV_SPLITS, head_dim] float32, unnormalised (KV_SPLITS > 1)
    partial_max_ptr,  # [num_tokens, num_q_heads, KV_SPLITS] float32: each split's running max, base 2
    partial_sum_ptr,  # [num_tokens, num_q_heads, KV_SPLITS] float32: each split's sum of weights
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,  # softmax scale times log2(e): the softmax runs in base 2
    stride_query_token,
    stride_query_head,
    stride_output_token,
    stride_output_head,
    stride_cache_block,  # key and value caches share one layout (checked by the host wrapper)
    stride_cache_slot,
    stride_cache_head,
    stride_block_table_seq,
    block_size,
    num_q_heads,
    KV_SPLITS: tl.constexpr,  # programs per (sequence, query tile, kv head), each over one range of keys
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PAD: tl.constexpr,  # next power of two, since tl.arange needs one
    BLOCK_Q: tl.constexpr,  # query tokens per program; the tile has BLOCK_Q * QUERIES_PER_KV_PAD rows
    TILE_KV: tl.constexpr,  # key positions per step of the inner loop
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    query_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // KV_SPLITS
    kv_split = tl.program_id(2) % KV_SPLITS

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row r of the tile is query token r // QUERIES_PER_KV_PAD under the group's query head
    # r % QUERIES_PER_KV_PAD, so each key/value tile loaded serves the whole GQA group.
    rows = tl.arange(0, BLOCK_Q * QUERIES_PER_KV_PAD)
    token = query_tile * BLOCK_Q + rows // QUERIES_PER_KV_PAD
    head_in_group = rows % QUERIES_PER_KV_PAD
    head = kv_head * QUERIES_PER_KV + head_in_group
    row_valid = (token < query_len) & (head_in_group < QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    query_position = context_len + token

    query_offsets = (
        (query_start + token)[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :]
    )
    q = tl.load(query_ptr + query_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    row_max = tl.full([BLOCK_Q * QUERIES_PER_KV_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * QUERIES_PER_KV_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * QUERIES_PER_KV_PAD, HEAD_DIM_PAD], tl.float32)

    # Keys after the tile's last query are invisible to all of its rows. This program takes the
    # `kv_split`-th of KV_SPLITS equal ranges of the rest, whole TILE_KV steps each (the last ones
    # may be empty: a row that sees no key of its range leaves max -inf and sum 0, which the merge weighs 0).
    kv_end = tl.minimum(seq_len, context_len + (query_tile + 1) * BLOCK_Q)
    split_len = tl.cdiv(tl.cdiv(kv_end, KV_SPLITS), TILE_KV) * TILE_KV
    kv_begin = kv_split * split_len
    kv_stop = tl.minimum(kv_begin + split_len, kv_end)
    for kv_start in range(kv_begin, kv_stop, TILE_KV):
        kv_position = kv_start + tl.arange(0, TILE_KV)
        kv_valid = kv_position < kv_stop
        block = tl.load(
            block_tables_ptr + seq * stride_block_table_seq + kv_position // block_size, mask=kv_valid, other=0
        ).to(tl.int64)
        slot_offsets = (
            block * stride_cache_block + (kv_position % block_size) * stride_cache_slot + kv_head * stride_cache_head
        )
        kv_offsets = slot_offsets[:, None] + dims[None, :]
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [TILE_KV, HEAD_DIM_PAD]
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [rows, TILE_KV]
        visible = (kv_position[None, :] <= query_position[:, None]) & kv_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf: subtract 0 instead, so its weights are exp2(-inf) = 0
        # rather than NaN. (Without splits every row sees position 0 in the first tile.)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - shift)
        weights = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if KV_SPLITS > 1:
        partial_row = ((query_start + token).to(tl.int64) * num_q_heads + head) * KV_SPLITS + kv_split
        tl.store(partial_max_ptr + partial_row, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row, row_sum, mask=row_valid)
        tl.store(partial_output_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_mask)
    else:
        output = acc / row_sum[:, None]
        output_offsets = (
            (query_start + token)[:, None] * stride_output_token + head[:, None] * stride_output_head + dims[None, :]
        )
        tl.store(output_ptr + output_offsets, output.to(output_ptr.dtype.element_ty), mask=store_mask)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int,
    scale: float,
    max_seq_len: int,
    tile_kv: int = 32,
    kv_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Attention of every packed query over its sequence's paged keys and values, causally.

    `max_seq_len` is the longest of `seq_lens` (known on the host, so nothing waits for the GPU);
    `kv_splits`, programs per query tile and kv head, is chosen from the batch (`split_kv`) unless given.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit key_cache {tuple(key_cache.shape)}: head_dim must match "
            "and num_q_heads must be a multiple of num_kv_heads"
        )
    if key_cache.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the caches are {key_cache.dtype}: they must match")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError("key_cache and value_cache must share one shape and layout")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("query, the caches and block_tables must be contiguous in their last dimension")
    if kv_splits is not None and (kv_splits < 1 or kv_splits & (kv_splits - 1)):
        raise ValueError(f"kv_splits must be a power of two, got {kv_splits}")

    output = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return output
    queries_per_kv = num_q_heads // num_kv_heads
    queries_per_kv_pad = triton.next_power_of_2(queries_per_kv)
    # tl.dot wants at least 16 rows; decode-only batches take no more than that.
    tile_rows = 16 if max_query_len == 1 else 64
    block_q = max(1, tile_rows // queries_per_kv_pad)
    num_query_tiles = triton.cdiv(max_query_len, block_q)
    if kv_splits is None:
        kv_splits = choose_kv_splits(num_seqs * num_query_tiles * num_kv_heads, max_seq_len, query.device)
    partials = PartialResults.allocate(num_tokens, num_q_heads, kv_splits, head_dim, query.device, output)
    grid = (num_seqs, num_query_tiles, num_kv_heads * kv_splits)
    _paged_attention_kernel[grid](
        output,
        partials.output,
        partials.max,
        partials.sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        key_cache.shape[1],
        num_q_heads,
        KV_SPLITS=kv_splits,
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PAD=queries_per_kv_pad,
        BLOCK_Q=block_q,
        TILE_KV=tile_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # Full fp32 products for fp32 inputs (Triton would default to tf32); 16-bit inputs use the default.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
    )
    if kv_splits > 1:
        merge_kv_splits(partials, output)
    return output
