"""The fast torch path for serving on CPU: read over the block table, then scaled-dot-product attention.

Per step, the batch splits three ways (`TorchAttentionPlan`, built once and shared by every layer):

- fresh prefills (no cached context) attend causally over this step's own keys and values, with no
  gather at all;
- prefill chunks with cached context attend in two parts merged by their log-sum-exp: over the
  cached positions, which every query of the chunk sees (read from the cache, no mask), and
  causally over the chunk's own keys and values (no gather). One call over the whole sequence under
  an explicit mask, as before, took 3-5% longer per step (SmolLM2, 50, 180 and 500 new tokens on 992
  cached: 134, 316 and 779 ms against 133, 306 and 750): the masked kernel adds the mask to every
  score and cannot skip the invisible half of the chunk's own square. (The kernel that returns the
  log-sum-exp exists on CPU only: elsewhere, as when `--attention-backend torch` runs on CUDA, the
  one masked call remains);
- decodes attend in groups, one SDPA call each: sorted by length and cut where padding to the
  group's longest member would waste much (`MAX_DECODE_PADDING`). On one thread a group costs about
  what one call per decode does (both are bound by reading the cache); with more threads one call
  parallelises over sequences and heads, which pays unless most of what it reads is padding;
- decodes whose sequences start with the same physical blocks (prefix-cache hits: a shared system
  prompt) attend as a cascade: the shared blocks are gathered once and attended by all their queries
  in one call, each sequence's own tail in a padded group, and the two partial results are merged by
  their log-sum-exp. Without it every decode reads the whole shared prefix again.

Where the native CPU kernels run (`native_cpu`: float32, AVX-512), they take over: every prefill,
fresh or after cached context, is one call of the prefill kernel, and every decode that is not part
of a cascade goes to one call of the decode kernel. Both read the keys and values through the block
tables in place: no gather, no staging, no merge. Cascades stay for large shared prefixes only
(`MIN_NATIVE_CASCADE_SAVED_POSITIONS`): the decode kernel re-reads a smaller one faster than a
cascade's extra calls and merge cost.

Gathers copy whole blocks (`index_select` over the block axis), which moves the same bytes as a
per-position gather in far fewer, larger copies. A sequence whose blocks are consecutive ids (common:
the free queue hands out runs, and a conversation's next turn finds its history where it left it) is
read as a view of the cache instead, with no copy at all (a batch-1 decode step of SmolLM2 went from
39.9 to 36.7 ms at a 1k-token context, 52.1 to 44.3 ms at 3k). Its values and strides are those the
gather would produce, so the result is the same to the bit. Decodes grouped into one call gather
(one call per decode over views was slower: batch 4 at 900 positions, 80 against 71 ms a step, as a
single decode gives the flash kernel only one work item per key/value head to spread over the
threads), but only once: with a `DecodeStaging`, a group that continues from the previous step
extends its kept keys and values by one position per member (`decode_staging`).

A padded decode group reads, masked out, the unused tail of each shorter member's last block: a cache
must hold finite values in every slot of the blocks in a table (`allocate_kv_cache` zero-fills; stale
keys and values are finite), since a zero weight times NaN is still NaN.

GQA costs no copies: the query heads of one key/value head are consecutive, so a `[.., num_q_heads, D]`
query viewed as `[.., num_kv_heads, group, D]` is a batch of `group` queries per key/value head. SDPA
only reaches its fast CPU kernel with 4-D inputs (3-D inputs run about five times slower here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefixcache.kernels.cpu.decode_staging import DecodeStaging, StagedGroup
from prefixcache.kernels.cpu.native import NativeCpuKernels
from prefixcache.kernels.metadata import AttentionMetadata

# A decode group's padded size stays within this factor of the positions its members really have.
MAX_DECODE_PADDING = 1.25
# Decodes sharing leading blocks attend as a cascade once that saves reading this many positions (below
# it the cascade's extra call and merge cost more than they save).
MIN_CASCADE_SAVED_POSITIONS = 256
# The same where the native decode kernel would otherwise read them: it re-reads a shared prefix
# cheaply, so a cascade pays only for more. Decode steps of SmolLM2 in process (2026-12-05), cascade
# against none: 8 decodes sharing 256 positions 45.9 / 39.8 ms, sharing 1,024 54.1 / 50.1 ms,
# 16 sharing 1,024 68.8 / 71.6 ms, 8 sharing 2,048 59.5 / 68.8 ms, 16 sharing 2,048 77.5 / 103.7 ms.
MIN_NATIVE_CASCADE_SAVED_POSITIONS = 8192


@dataclass
class FreshPrefill:
    tokens: slice


@dataclass
class NativePrefill:
    tokens: slice
    blocks: torch.Tensor  # [num_blocks] int64: every block of the sequence, in order
    seq_len: int


@dataclass
class NativeDecodes:
    token_rows: torch.Tensor  # [num_decodes] int64: rows in the packed batch
    block_tables: torch.Tensor  # [num_decodes, blocks of the longest] int64
    seq_lens: torch.Tensor  # [num_decodes] int64


@dataclass
class ContextPrefill:
    tokens: slice
    blocks: torch.Tensor  # [num_blocks] int64: the blocks holding the cached positions, in order
    first_block: int | None  # blocks[0] when the blocks are consecutive ids (read as a view)
    context_len: int  # cached positions before this chunk


class Decode(NamedTuple):
    seq_len: int
    seq: int  # index in the batch
    token: int  # row in the packed batch


@dataclass
class DecodeBatch:
    token_index: torch.Tensor  # [num_decodes] int64: rows of the decodes in the packed batch
    blocks: torch.Tensor  # [num_decodes, blocks of the longest] int64, padded with each row's first block
    first_block: int | None  # for one decode whose blocks are consecutive ids: the first (read as a view)
    max_len: int
    visible: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool; None when no row is padded
    lens: list[int]  # each decode's positions read (a cascade tail's: after the shared blocks)
    staged: StagedGroup | None = None  # keys and values kept from the previous step (see `decode_staging`)


@dataclass
class CascadeDecodes:
    shared_blocks: torch.Tensor  # [num_shared_blocks] int64: the leading blocks every member's table holds
    first_shared_block: int | None  # shared_blocks[0] when they are consecutive ids (read as a view)
    tails: DecodeBatch  # each member's positions after the shared blocks


@dataclass
class TorchAttentionPlan:
    fresh_prefills: list[FreshPrefill]
    context_prefills: list[ContextPrefill]
    native_prefills: list[NativePrefill]
    native_decodes: NativeDecodes | None
    decode_batches: list[DecodeBatch]
    cascades: list[CascadeDecodes]

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, staging: DecodeStaging | None = None,
              native: bool = False) -> TorchAttentionPlan:
        """The plan of one step; with `staging`, decode groups keep their keys and values between
        steps (CPU only); with `native`, prefills and decodes outside cascades go to the native kernels."""
        fresh: list[FreshPrefill] = []
        context: list[ContextPrefill] = []
        native_prefills: list[NativePrefill] = []
        decodes: list[Decode] = []
        start = 0
        for seq, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            tokens = slice(start, start + query_len)
            if native and query_len > 1:
                native_prefills.append(NativePrefill(tokens, meta.block_tables[seq, : -(-seq_len // block_size)].long(),
                                                     seq_len))
            elif query_len == seq_len:
                fresh.append(FreshPrefill(tokens))
            elif query_len == 1:
                decodes.append(Decode(seq_len, seq, start))
            else:
                context_len = seq_len - query_len
                blocks = meta.block_tables[seq, : -(-context_len // block_size)].long()
                context.append(ContextPrefill(tokens, blocks, _first_if_consecutive(blocks.tolist()), context_len))
            start += query_len
        min_saved = MIN_NATIVE_CASCADE_SAVED_POSITIONS if native else MIN_CASCADE_SAVED_POSITIONS
        cascades, decodes = _find_cascades(meta, decodes, block_size, min_saved)
        native_decodes = _native_decodes(meta, decodes, block_size) if native and decodes else None
        batches = [] if native else [_decode_batch(meta, group, block_size) for group in _group_decodes(decodes)]
        if staging is not None and meta.block_tables.device.type == "cpu":
            _stage(batches + [cascade.tails for cascade in cascades], staging, block_size)
        return cls(fresh, context, native_prefills, native_decodes, batches, cascades)


def _stage(batches: list[DecodeBatch], staging: DecodeStaging, block_size: int) -> None:
    """Give every decode group that would gather a staged group, as far as the staging's budget goes."""
    gathering = [batch for batch in batches if batch.first_block is None]
    groups = [([row[: -(-n // block_size)] for row, n in zip(batch.blocks.tolist(), batch.lens)], batch.lens)
              for batch in gathering]
    for batch, staged in zip(gathering, staging.stage(groups, block_size)):
        batch.staged = staged


def _find_cascades(
    meta: AttentionMetadata, decodes: list[Decode], block_size: int, min_saved_positions: int
) -> tuple[list[CascadeDecodes], list[Decode]]:
    """Split off decodes that share leading blocks worth attending once (saving at least
    `min_saved_positions` reads); return them and the rest.

    Only blocks wholly before a decode's own position count: the shared part then never holds a
    member's last position, so every member keeps a non-empty tail. CPU only (see `_attend_cascade`).
    """
    if meta.block_tables.device.type != "cpu":
        return [], decodes
    by_first_block: dict[int, list[tuple[Decode, list[int]]]] = {}
    for decode in decodes:
        table = meta.block_tables[decode.seq, : (decode.seq_len - 1) // block_size].tolist()
        if table:
            by_first_block.setdefault(table[0], []).append((decode, table))
    cascades: list[CascadeDecodes] = []
    cascaded: set[int] = set()
    for group in by_first_block.values():
        first_table = group[0][1]
        num_shared = min(len(table) for _, table in group)
        for _, table in group[1:]:
            num_shared = next((i for i in range(num_shared) if table[i] != first_table[i]), num_shared)
        if (len(group) - 1) * num_shared * block_size < min_saved_positions:
            continue
        members = sorted((decode for decode, _ in group), reverse=True)
        shared = first_table[:num_shared]
        cascades.append(CascadeDecodes(torch.tensor(shared, dtype=torch.int64), _first_if_consecutive(shared),
                                       _decode_batch(meta, members, block_size, skip_blocks=num_shared)))
        cascaded.update(decode.seq for decode in members)
    return cascades, [decode for decode in decodes if decode.seq not in cascaded]


def _native_decodes(meta: AttentionMetadata, decodes: list[Decode], block_size: int) -> NativeDecodes:
    width = -(-max(decode.seq_len for decode in decodes) // block_size)
    rows = torch.tensor([decode.seq for decode in decodes])
    return NativeDecodes(torch.tensor([decode.token for decode in decodes]),
                         meta.block_tables[rows, :width].long().contiguous(),
                         torch.tensor([decode.seq_len for decode in decodes]))


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


def _decode_batch(meta: AttentionMetadata, group: list[Decode], block_size: int, skip_blocks: int = 0) -> DecodeBatch:
    """Decodes longest first, attending to their positions from block `skip_blocks` on."""
    device = meta.block_tables.device
    lens = [decode.seq_len - skip_blocks * block_size for decode in group]
    tokens = [decode.token for decode in group]
    max_len = lens[0]
    num_blocks = -(-max_len // block_size)
    rows = torch.tensor([decode.seq for decode in group], device=device)
    blocks = meta.block_tables[rows, skip_blocks : skip_blocks + num_blocks].long()
    first_block = _first_if_consecutive(blocks[0].tolist()) if len(group) == 1 else None
    visible = None
    if min(lens) != max_len:
        # Past its own blocks a row holds table padding, which may name any block: read the row's
        # first block there instead, which is finite (see the module docstring), and mask it out.
        lens_tensor = torch.tensor(lens, device=device)[:, None]
        owned = torch.arange(num_blocks, device=device)[None, :] < -(-lens_tensor // block_size)
        blocks = torch.where(owned, blocks, blocks[:, :1])
        visible = (torch.arange(max_len, device=device)[None, :] < lens_tensor)[:, None, None, :]
    return DecodeBatch(torch.tensor(tokens, device=device), blocks, first_block, max_len, visible, lens)


def _first_if_consecutive(block_ids: list[int]) -> int | None:
    """`block_ids[0]` if the ids run consecutively upwards (one slice of the cache holds them), else None."""
    first = block_ids[0]
    if block_ids[-1] - first == len(block_ids) - 1 and block_ids == list(range(first, first + len(block_ids))):
        return first
    return None


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
