"""The fast torch path for serving on CPU: gather over the block table, then scaled-dot-product attention.

Per step, the batch splits three ways (`TorchAttentionPlan`, built once and shared by every layer):

- fresh prefills (no cached context) attend causally over this step's own keys and values, with no
  gather at all;
- prefill chunks with cached context gather their sequence's blocks from the cache (this step's
  tokens included: they were written first) and attend under an explicit mask, since SDPA's
  `is_causal` aligns the diagonal top-left and our queries sit at the end of the sequence;
- decodes attend in groups, one SDPA call each: sorted by length and cut where padding to the
  group's longest member would waste much (`MAX_DECODE_PADDING`). On one thread a group costs about
  what one call per decode does (both are bound by reading the cache); with more threads one call
  parallelises over sequences and heads, which pays unless most of what it reads is padding.

Gathers copy whole blocks (`index_select` over the block axis), which moves the same bytes as a
per-position gather in far fewer, larger copies. A padded decode group therefore reads, masked out,
the unused tail of each shorter member's last block: a cache must hold finite values in every slot
of the blocks in a table (`allocate_kv_cache` zero-fills; stale keys and values are finite), since a
zero weight times NaN is still NaN.

GQA costs no copies: the query heads of one key/value head are consecutive, so a `[.., num_q_heads, D]`
query viewed as `[.., num_kv_heads, group, D]` is a batch of `group` queries per key/value head. SDPA
only reaches its fast CPU kernel with 4-D inputs (3-D inputs run about five times slower here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

# A decode group's padded size stays within this factor of the positions its members really have.
MAX_DECODE_PADDING = 1.25


@dataclass
class FreshPrefill:
    tokens: slice


@dataclass
class ContextPrefill:
    tokens: slice
    blocks: torch.Tensor  # [num_blocks] int64: the sequence's blocks, in order
    seq_len: int
    visible: torch.Tensor  # [query_len, seq_len] bool


class Decode(NamedTuple):
    seq_len: int
    seq: int  # index in the batch
    token: int  # row in the packed batch


@dataclass
class DecodeBatch:
    token_index: torch.Tensor  # [num_decodes] int64: rows of the decodes in the packed batch
    blocks: torch.Tensor  # [num_decodes, blocks of the longest] int64, padded with each row's first block
    max_len: int
    visible: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool; None when no row is padded


@dataclass
class TorchAttentionPlan:
    fresh_prefills: list[FreshPrefill]
    context_prefills: list[ContextPrefill]
    decode_batches: list[DecodeBatch]

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> TorchAttentionPlan:
        device = meta.block_tables.device
        fresh: list[FreshPrefill] = []
        context: list[ContextPrefill] = []
        decodes: list[Decode] = []
        start = 0
        for seq, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            tokens = slice(start, start + query_len)
            if query_len == seq_len:
                fresh.append(FreshPrefill(tokens))
            elif query_len == 1:
                decodes.append(Decode(seq_len, seq, start))
            else:
                blocks = meta.block_tables[seq, : -(-seq_len // block_size)].long()
                positions = torch.arange(seq_len, device=device)
                query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
                visible = positions[None, :] <= query_positions[:, None]
                context.append(ContextPrefill(tokens, blocks, seq_len, visible))
            start += query_len
        batches = [_decode_batch(meta, group, block_size) for group in _group_decodes(decodes)]
        return cls(fresh, context, batches)


def _group_decodes(decodes: list[Decode]) -> list[list[Decode]]:
    """Longest first, a decode joins the current group while the group's padding stays small."""
    groups: list[list[Decode]] = []
    real_positions = 0
    for decode in sorted(decodes, reverse=True):
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * group[0].seq_len
            if padded <= MAX_DECODE_PADDING * (real_positions + decode.seq_len):
                group.append(decode)
                real_positions += decode.seq_len
                continue
        groups.append([decode])
        real_positions = decode.seq_len
    return groups


def _decode_batch(meta: AttentionMetadata, group: list[Decode], block_size: int) -> DecodeBatch:
    device = meta.block_tables.device
    lens = [decode.seq_len for decode in group]
    tokens = [decode.token for decode in group]
    max_len = lens[0]
    num_blocks = -(-max_len // block_size)
    blocks = meta.block_tables[torch.tensor([decode.seq for decode in group], device=device), :num_blocks].long()
    visible = None
    if min(lens) != max_len:
        # Past its own blocks a row holds table padding, which may name any block: read the row's
        # first block there instead, which is finite (see the module docstring), and mask it out.
        lens_tensor = torch.tensor(lens, device=device)[:, None]
        owned = torch.arange(num_blocks, device=device)[None, :] < -(-lens_tensor // block_size)
        blocks = torch.where(owned, blocks, blocks[:, :1])
        visible = (torch.arange(max_len, device=device)[None, :] < lens_tensor)[:, None, None, :]
    return DecodeBatch(torch.tensor(tokens, device=device), blocks, max_len, visible)


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
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    num_kv_heads, head_dim = key_cache.shape[2:]
    group = query.shape[1] // num_kv_heads
    output = torch.empty_like(query)

    for prefill in plan.fresh_prefills:
        rows = prefill.tokens
        output[rows] = _sdpa_prefill(query[rows], key[rows], value[rows], None, scale)
    for prefill in plan.context_prefills:
        rows = prefill.tokens
        keys = _gather_blocks(key_cache, prefill.blocks)[: prefill.seq_len]  # [seq_len, num_kv_heads, D]
        values = _gather_blocks(value_cache, prefill.blocks)[: prefill.seq_len]
        output[rows] = _sdpa_prefill(query[rows], keys, values, prefill.visible, scale)
    for decodes in plan.decode_batches:
        num_decodes = decodes.blocks.shape[0]
        keys = _gather_blocks(key_cache, decodes.blocks)[:, : decodes.max_len]  # [num_decodes, max_len, heads, D]
        values = _gather_blocks(value_cache, decodes.blocks)[:, : decodes.max_len]
        queries = query.index_select(0, decodes.token_index).view(num_decodes, num_kv_heads, group, head_dim)
        attended = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=decodes.visible, scale=scale
        )
        output.index_copy_(0, decodes.token_index, attended.reshape(num_decodes, -1, head_dim))
    return output


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`[..., num_blocks]` block ids -> `[..., num_blocks * block_size, num_kv_heads, head_dim]` positions."""
    gathered = cache.index_select(0, blocks.reshape(-1))
    return gathered.view(*blocks.shape[:-1], -1, *cache.shape[2:])


def _sdpa_prefill(
    query: torch.Tensor,  # [query_len, num_q_heads, D]
    keys: torch.Tensor,  # [kv_len, num_kv_heads, D]
    values: torch.Tensor,
    visible: torch.Tensor | None,  # [query_len, kv_len] bool, or None for plain causal (query_len == kv_len)
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, D]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=visible,
        is_causal=visible is None,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)
