"""Per-step attention metadata: where each new token goes in the paged KV cache and what it may attend to.

The model runner builds one `AttentionMetadata` per step and passes it to every layer. The batch is
packed: the new tokens of all sequences sit back to back in one `[num_tokens, ...]` tensor, sequence
`b` owning rows `query_start_loc[b]:query_start_loc[b + 1]`. Query `i` of sequence `b` sits at the
absolute position `seq_lens[b] - query_len_b + i` and attends to every position up to and including it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, rows padded with 0
    max_query_len: int
    # Host-side copies, so that CPU code paths never read device tensors back; derived when not given.
    query_lens_list: list[int] | None = None
    seq_lens_list: list[int] | None = None
    # Backends cache what they derive from this step's metadata here (once per step, not per layer).
    backend_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.query_lens_list is None:
            self.query_lens_list = self.query_start_loc.diff().tolist()
        if self.seq_lens_list is None:
            self.seq_lens_list = self.seq_lens.tolist()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Validate one step's batch description and turn it into device tensors."""
        _validate(query_lens, seq_lens, block_tables, block_size)
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            for position in range(seq_len - query_len, seq_len):
                slots.append(table[position // block_size] * block_size + position % block_size)
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        width = max((len(table) for table in block_tables), default=0)
        padded_tables = [table + [0] * (width - len(table)) for table in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device).view(len(seq_lens), width),
            max_query_len=max(query_lens, default=0),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )


def _validate(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
            f"{len(query_lens)}, {len(seq_lens)} and {len(block_tables)}"
        )
    for index, (query_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if query_len < 1:
            raise ValueError(f"query_lens[{index}] must be at least 1, got {query_len}")
        if seq_len < query_len:
            raise ValueError(f"seq_lens[{index}]={seq_len} is shorter than query_lens[{index}]={query_len}")
        needed = -(-seq_len // block_size)
        if len(table) < needed:
            raise ValueError(
                f"block_tables[{index}] has {len(table)} blocks but seq_lens[{index}]={seq_len} needs {needed}"
            )
        if any(block < 0 for block in table[:needed]):
            raise ValueError(f"block_tables[{index}] holds a negative block id: {table[:needed]}")
