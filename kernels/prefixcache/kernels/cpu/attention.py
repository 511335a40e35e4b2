"""The CPU attention path: write this step's keys and values into the paged cache, then attend to each
part of the step's plan (`attention_plan`) with torch's SDPA or the native kernels.

A prefill chunk after cached context attends in two parts merged by their log-sum-exp: over the cached
positions, which every query of the chunk sees (no mask), and causally over the chunk's own keys and
values (no gather). One call over the whole sequence under an explicit mask costs more: the masked
kernel adds the mask to every score and cannot skip the invisible half of the chunk's own square. The
flash kernel that returns the log-sum-exp exists on CPU only, so elsewhere (`--attention-backend torch`
on CUDA) the one masked call remains. Cascades merge their shared and own parts the same way.

Reads copy whole blocks (`index_select` over the block axis): the same bytes as a per-position gather
in far fewer, larger copies. Where the plan found a sequence's blocks to be consecutive ids, they are
read as a view of the cache instead, with no copy at all; its values and strides are those the gather
would produce, so the result is the same to the bit. A decode group of several members still gathers:
a single decode gives the flash kernel only one work item per key/value head to spread over the
threads, so one call per decode over views is slower than one call over the gathered group. With a
`DecodeStaging`, a group that continues from the previous step gathers only once and then extends its
kept keys and values by one position per member (`decode_staging`).

A padded decode group reads, masked out, the unused tail of each shorter member's last block: a cache
must hold finite values in every slot of the blocks in a table (`allocate_kv_cache` zero-fills; stale
keys and values are finite), since a zero weight times NaN is still NaN.

GQA costs no copies: the query heads of one key/value head are consecutive, so a `[.., num_q_heads, D]`
query viewed as `[.., num_kv_heads, group, D]` is a batch of `group` queries per key/value head. SDPA
only reaches its fast CPU kernel with 4-D inputs (3-D inputs run much slower), so every call here is 4-D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixcache.kernels.cpu.attention_plan import CascadeDecodes, ContextPrefill, DecodeBatch, TorchAttentionPlan
from prefixcache.kernels.cpu.native import NativeCpuKernels


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[t]`/`value[t]` into cache slot `slot_mapping[t]` (caches must be contiguous)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def attend_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys, already in the cache
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    native: NativeCpuKernels | None = None,  # runs `plan.native_prefills` and `plan.native_decodes`
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    head_dim = key_cache.shape[3]
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, as the kernels write it

    for prefill in plan.native_prefills:
        rows = prefill.tokens
        native.prefill_attention(query[rows], key_cache, value_cache, prefill.blocks, prefill.seq_len, scale,
                                 out=output[rows])
    if plan.native_decodes is not None:
        decodes = plan.native_decodes
        native.decode_attention(query, decodes.token_rows, key_cache, value_cache, decodes.block_tables,
                                decodes.seq_lens, scale, out=output)
    for prefill in plan.fresh_prefills:
        rows = prefill.tokens
        output[rows] = _sdpa_prefill(query[rows], key[rows], value[rows], scale)
    for prefill in plan.context_prefills:
        rows = prefill.tokens
        output[rows] = _attend_context_prefill(query[rows], key[rows], value[rows], key_cache, value_cache, prefill,
                                               scale)
    for decodes in plan.decode_batches:
        queries, keys, values = _decode_inputs(query, key_cache, value_cache, decodes)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=decodes.visible, scale=scale)
        output.index_copy_(0, decodes.token_index, attended.reshape(queries.shape[0], -1, head_dim))
    for cascade in plan.cascades:
        attended = _attend_cascade(query, key_cache, value_cache, cascade, scale)
        output.index_copy_(0, cascade.tails.token_index, attended.reshape(attended.shape[0], -1, head_dim))
    return output


_flash_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _decode_inputs(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, decodes: DecodeBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode group's queries `[n, kv heads, group, D]` and its keys and values `[n, kv heads, max_len, D]`.

    The query heads of one key/value head become a batch of `group` queries (GQA without copies)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    num_decodes = decodes.blocks.shape[0]
    queries = query.index_select(0, decodes.token_index).view(num_decodes, num_kv_heads, -1, head_dim)
    if decodes.staged is not None:
        keys, values = decodes.staged.read(key_cache, value_cache, decodes.blocks, decodes.max_len)
        return queries, keys, values
    keys = _read_blocks(key_cache, decodes.blocks, decodes.first_block)[:, : decodes.max_len]
    values = _read_blocks(value_cache, decodes.blocks, decodes.first_block)[:, : decodes.max_len]
    return queries, keys.transpose(1, 2), values.transpose(1, 2)


def _attend_cascade(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cascade: CascadeDecodes, scale: float
) -> torch.Tensor:  # [members, num_kv_heads, group, D]
    """Attention of decodes over their shared blocks plus their own tails, merged exactly.

    Softmax over the union of two disjoint key sets: each part's output weighted by
    exp(its log-sum-exp - the union's log-sum-exp). SDPA does not return the log-sum-exp, so this
    calls the CPU flash kernel SDPA itself dispatches to (CPU only; CUDA runs the Triton kernel).
    """
    tails = cascade.tails
    queries, tail_keys, tail_values = _decode_inputs(query, key_cache, value_cache, tails)
    members, num_kv_heads, group, head_dim = queries.shape

    # Every member's queries against the shared keys in one call: [1, kv heads, members * group, D].
    stacked = queries.transpose(0, 1).reshape(1, num_kv_heads, members * group, head_dim)
    shared_keys = _read_blocks(key_cache, cascade.shared_blocks, cascade.first_shared_block).transpose(0, 1)[None]
    shared_values = _read_blocks(value_cache, cascade.shared_blocks, cascade.first_shared_block).transpose(0, 1)[None]
    shared, shared_lse = _flash_attention_with_lse(stacked, shared_keys, shared_values, scale=scale)
    shared = shared.view(num_kv_heads, members, group, head_dim).transpose(0, 1)
    shared_lse = shared_lse.view(num_kv_heads, members, group).transpose(0, 1)

    mask = None
    if tails.visible is not None:  # the flash kernel takes an additive mask in the query's dtype
        mask = torch.zeros(tails.visible.shape, dtype=query.dtype, device=query.device)
        mask.masked_fill_(~tails.visible, float("-inf"))
    own, own_lse = _flash_attention_with_lse(queries, tail_keys, tail_values, attn_mask=mask, scale=scale)

    return _merge_by_lse(shared, shared_lse, own, own_lse).to(query.dtype)


def _attend_context_prefill(
    query: torch.Tensor,  # [query_len, num_q_heads, D]: a chunk's queries
    key: torch.Tensor,  # [query_len, num_kv_heads, D]: the chunk's own keys and values
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    prefill: ContextPrefill,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, D]
    """A prefill chunk after `prefill.context_len` cached positions: the cached part, seen whole by
    every query, and the chunk's own causal square, attended separately and merged (the flash kernel
    that returns the log-sum-exp runs on CPU only; elsewhere one masked call does it all)."""
    context_keys = _read_blocks(key_cache, prefill.blocks, prefill.first_block)[: prefill.context_len]
    context_values = _read_blocks(value_cache, prefill.blocks, prefill.first_block)[: prefill.context_len]
    if query.device.type != "cpu":
        return _masked_context_prefill(query, key, value, context_keys, context_values, scale)
    queries = query.transpose(0, 1)[None]  # [1, num_q_heads, query_len, D]
    context, context_lse = _flash_attention_with_lse(
        queries, context_keys.transpose(0, 1)[None], context_values.transpose(0, 1)[None], scale=scale)
    own, own_lse = _flash_attention_with_lse(
        queries, key.transpose(0, 1)[None], value.transpose(0, 1)[None], is_causal=True, scale=scale)
    merged = _merge_by_lse(context[0], context_lse[0], own[0], own_lse[0])  # [num_q_heads, query_len, D]
    return merged.to(query.dtype).transpose(0, 1)


def _masked_context_prefill(
    query: torch.Tensor,  # [query_len, num_q_heads, D]
    key: torch.Tensor,  # [query_len, num_kv_heads, D]
    value: torch.Tensor,
    context_keys: torch.Tensor,  # [context_len, num_kv_heads, D]
    context_values: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, D]
    """`_attend_context_prefill` as one SDPA call over the context and the chunk under a causal mask."""
    context_len, query_len = context_keys.shape[0], query.shape[0]
    keys = torch.cat([context_keys, key]).transpose(0, 1)[None]
    values = torch.cat([context_values, value]).transpose(0, 1)[None]
    positions = torch.arange(context_len + query_len, device=query.device)
    visible = positions[None, :] <= positions[context_len:, None]  # query i sits at context_len + i
    attended = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys, values, attn_mask=visible,
                                              scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)


def _merge_by_lse(first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor,
                  second_lse: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each part's output `[..., D]`
    and log-sum-exp `[...]`, in float32. The first part's weight is exp(its lse - the union's lse),
    which is sigmoid(first_lse - second_lse): one op instead of four."""
    first_weight = torch.sigmoid(first_lse - second_lse)[..., None]
    second = second.float()
    return (first.float() - second).mul_(first_weight).add_(second)


def _read_blocks(cache: torch.Tensor, blocks: torch.Tensor, first_block: int | None) -> torch.Tensor:
    """`[..., num_blocks]` block ids -> `[..., num_blocks * block_size, num_kv_heads, head_dim]` positions.

    A copy, unless `first_block` says the ids are consecutive: then a view of the cache."""
    if first_block is None:
        read = cache.index_select(0, blocks.reshape(-1))
    else:
        read = cache[first_block : first_block + blocks.shape[-1]]
    return read.view(*blocks.shape[:-1], -1, *cache.shape[2:])


def _sdpa_prefill(
    query: torch.Tensor,  # [query_len, num_q_heads, D]
    keys: torch.Tensor,  # [query_len, num_kv_heads, D]: the same positions, attended causally
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, D]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)
