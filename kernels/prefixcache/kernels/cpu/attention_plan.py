"""How the CPU attention path splits one step's batch: built once per step, shared by every layer.

Each sequence of the step lands in one part, and `attention.attend_torch` runs each part its own way:

- fresh prefills (no cached context) attend causally over this step's own keys and values, with no
  gather at all;
- prefill chunks with cached context attend over the cached positions and, separately, causally over
  the chunk's own keys and values, merged by their log-sum-exp (see `attention`);
- decodes attend in groups, one SDPA call each: sorted by length and cut where padding to the group's
  longest member would waste much (`MAX_DECODE_PADDING`). On one thread a group costs about what one
  call per decode does (both are bound by reading the cache); with more threads one call parallelises
  over sequences and heads, which pays unless most of what it reads is padding;
- decodes whose sequences start with the same physical blocks (prefix-cache hits: a shared system
  prompt) attend as a cascade: the shared blocks once for all their queries, each sequence's own tail
  in a padded group. Without it every decode reads the whole shared prefix again. A cascade costs an
  extra call and a merge, so it is planned only where it saves enough reading
  (`MIN_CASCADE_SAVED_POSITIONS`).

Where the native CPU kernels run (`native=True`: float32, AVX-512), every prefill, fresh or after
cached context, is one call of the native prefill kernel and every decode outside a cascade goes to
one call of the native decode kernel; both read the cache through the block tables in place. That
kernel re-reads a shared prefix cheaply, so cascades stay for large shared prefixes only
(`MIN_NATIVE_CASCADE_SAVED_POSITIONS`).

A sequence whose blocks are consecutive ids (common: the free queue hands out runs, and a
conversation's next turn finds its history where it left it) is marked with its first block, so that
attention reads it as a view of the cache instead of a gathered copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from prefixcache.kernels.cpu.decode_staging import DecodeStaging, StagedGroup
from prefixcache.kernels.metadata import AttentionMetadata

# A decode group's padded size stays within this factor of the positions its members really have.
MAX_DECODE_PADDING = 1.25
# Decodes sharing leading blocks attend as a cascade once that saves reading this many positions (below
# it the cascade's extra call and merge cost more than they save).
MIN_CASCADE_SAVED_POSITIONS = 256
# The same where the native decode kernel would otherwise read them: it re-reads a shared prefix
# cheaply, so a cascade pays only for more.
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
    member's last position, so every member keeps a non-empty tail. CPU only (the cascade's merge needs
    the log-sum-exp, which torch's flash kernel returns on CPU only; see `attention`).
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
        # first block there instead, which is finite (a cache holds finite values in every slot; see
        # `attention`), and mask it out.
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
