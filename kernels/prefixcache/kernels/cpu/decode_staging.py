"""Decode keys and values kept in contiguous buffers from one step to the next (the CPU torch path).

A decode group attends over its members' whole contexts, which the paged cache holds in scattered
blocks. Gathering them into one tensor copies every context again at every step and in every layer,
a large share of a decode step's time at long contexts. A staged group keeps its members' keys and
values in per-layer buffers instead: gathered once when the group forms, then extended by each
member's newest position, read from the cache after this step's write.

The cache stays the only source of truth. A buffer holds, at every position a member can see, the
bytes a gather would read, so attention gives the same result to the bit. A group continues only
when the same members, in the same order, hold the same blocks as in the previous step (plus maybe a
new one) and one more position each; any other change (a member finished, joined or was preempted)
gathers afresh. Each layer's buffers also record the lengths they hold and gather afresh when those
are not one short of this step's, so a step that failed half-way leaves nothing stale behind.

Buffers hold each key/value head's positions contiguously (`[members, heads, positions, dim]`), not
in the cache's position-major order: the CPU flash kernel would otherwise pack the strided keys and
values itself in every layer, a large part of its time (it gives the same bits either way).

Buffers take memory beside the cache, at most `max_positions` positions per layer in all (the model
runner allows half the cache's positions, less if free memory is short). Groups beyond that, and
groups too small to gain (`MIN_GROUP_POSITIONS`), are gathered every step, as before.

Staging saves less than the gathers' whole share of a step: a fresh gather leaves its data in the CPU
cache for the attention right after it, while staged buffers are read from memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Positions a group's buffers hold beyond its longest member when they are made: the group can
# decode this many steps before its buffers must grow (by a fresh gather).
HEADROOM_POSITIONS = 128
# Smaller groups (members x longest member) gather every step: their gather is cheap and stays in the
# CPU cache for the attention after it, and the appends' fixed cost would outweigh it.
MIN_GROUP_POSITIONS = 2048


@dataclass(eq=False)
class _LayerBuffers:
    keys: torch.Tensor  # [members, num_kv_heads, capacity, head_dim]
    values: torch.Tensor
    lens: list[int]  # positions held per member


@dataclass(eq=False)
class StagedGroup:
    """One decode group's keys and values, per layer; the members' state as of the current step."""

    tables: list[list[int]]  # each member's block ids, as many as hold its positions
    lens: list[int]  # each member's positions
    capacity: int  # positions per member in the buffers
    block_size: int
    _layers: dict[int, _LayerBuffers] = field(default_factory=dict)  # by the layer's key cache address
    _previous_lens: list[int] = field(default_factory=list)  # what a layer's buffers hold if it can append
    _newest: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # members, positions, cache slots

    def continues_as(self, tables: list[list[int]], lens: list[int]) -> bool:
        """Whether `tables`/`lens` are this group one decode later."""
        return (
            len(lens) == len(self.lens)
            and max(lens) <= self.capacity
            and all(new == old + 1 for new, old in zip(lens, self.lens))
            and all(new[: len(old)] == old for new, old in zip(tables, self.tables))
        )

    def advance(self, tables: list[list[int]], lens: list[int]) -> None:
        """Move to this step: each member gained one position, its newest."""
        positions = [length - 1 for length in lens]  # each member's newest, and what it held before
        self._previous_lens = positions
        self.tables, self.lens = tables, lens
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size
                 for table, p in zip(tables, positions)]
        self._newest = (torch.arange(len(lens)), torch.tensor(positions), torch.tensor(slots))

    def read(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, `[members, num_kv_heads, max_len, head_dim]` each: every
        head's positions contiguous, which the CPU flash kernel reads faster than the cache's
        position-major order (it gives the same bits either way).

        `blocks` is the group's padded block table (what a gather would read); the cache already
        holds this step's keys and values. `advance` must have been called for this step."""
        layer = key_cache.data_ptr()
        buffers = self._layers.get(layer)
        if buffers is not None and buffers.lens == self._previous_lens:
            members, positions, slots = self._newest
            num_kv_heads, head_dim = key_cache.shape[2:]
            buffers.keys[members, :, positions] = key_cache.view(-1, num_kv_heads, head_dim)[slots]
            buffers.values[members, :, positions] = value_cache.view(-1, num_kv_heads, head_dim)[slots]
        else:
            buffers = self._layers[layer] = _LayerBuffers(
                self._gather(key_cache, blocks), self._gather(value_cache, blocks), []
            )
        buffers.lens = self.lens
        return buffers.keys[:, :, :max_len], buffers.values[:, :, :max_len]

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        members, num_blocks = blocks.shape
        num_gathered = num_blocks * self.block_size
        num_kv_heads, head_dim = cache.shape[2:]
        buffer = cache.new_empty(members, num_kv_heads, self.capacity, head_dim)
        gathered = cache.index_select(0, blocks.reshape(-1)).view(members, num_gathered, num_kv_heads, head_dim)
        buffer[:, :, :num_gathered] = gathered.transpose(1, 2)
        # Past a member's own positions lie masked slots, which must hold finite values.
        buffer[:, :, num_gathered:] = 0
        return buffer


class DecodeStaging:
    """The staged decode groups of the latest step, kept for the next one."""

    def __init__(self, max_positions: int, min_group_positions: int = MIN_GROUP_POSITIONS) -> None:
        if max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {max_positions}")
        self.max_positions = max_positions
        self.min_group_positions = min_group_positions
        self._groups: dict[tuple[int, ...], StagedGroup] = {}

    def stage(self, groups: list[tuple[list[list[int]], list[int]]], block_size: int) -> list[StagedGroup | None]:
        """For this step's decode groups, each `(tables, lens)` with members in attention order, the
        staged group that serves it (continued from the last step or new), or None for groups under
        `min_group_positions` or beyond `max_positions`. Groups of the last step that do not continue
        are dropped."""
        budget = self.max_positions
        previous, self._groups = self._groups, {}
        staged: list[StagedGroup | None] = []
        for tables, lens in groups:
            if len(lens) * max(lens) < self.min_group_positions:
                staged.append(None)
                continue
            key = tuple(table[0] for table in tables)
            group = previous.pop(key, None)
            if group is None or not group.continues_as(tables, lens):
                capacity = -(-(max(lens) + HEADROOM_POSITIONS) // block_size) * block_size
                group = StagedGroup(tables, lens, capacity, block_size)
            if len(lens) * group.capacity > budget or key in self._groups:
                staged.append(None)
                continue
            budget -= len(lens) * group.capacity
            group.advance(tables, lens)
            self._groups[key] = group
            staged.append(group)
        return staged
