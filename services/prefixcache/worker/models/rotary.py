"""Rotary position embeddings, with the frequency layouts Llama-family checkpoints use.

Cos/sin tables are computed once in float32 for every position up to the context limit, the same
arithmetic as transformers (so float32 logits agree), and cast to the model's dtype.
"""
from __future__ import annotations

import math

import torch

from prefixcache.worker.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 angular speed of each rotated pair."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.scaling["factor"]
    if rope.kind == "llama3":
        return _llama3_frequencies(inv_freq, rope.scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1 scaling: slow (long-wavelength) pairs divided by `factor`, fast ones kept, a blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original_context / low, inv_freq / factor, inv_freq)
    blend = (original_context / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = (wavelength >= original_context / high) & (wavelength <= original_context / low)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding:
    """Cos/sin of each absolute position, for rotating heads in the "rotate half" layout.

    The sine table comes with the first half negated (`signed_sin`), which folds rotate-half's
    negation into the table: `-x2 * sin == x2 * -sin` exactly, so `rotate` does one op less per
    layer and gives the same bits.

    Holds no parameters: the tables are built on first use on the device and in the dtype of the
    queries, so constructing a model on the meta device and loading weights later needs no special care.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each [T, 1, head_dim], for the tokens at `positions` [T]; once per step."""
        cos_table, signed_sin_table = self._tables_for(positions.device, dtype)
        return cos_table[positions].unsqueeze(1), signed_sin_table[positions].unsqueeze(1)

    def _tables_for(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._tables:
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            angles = torch.outer(positions, inverse_frequencies(self.rope, self.head_dim))
            cos, sin = angles.cos(), angles.sin()
            cos_table = torch.cat((cos, cos), dim=-1)  # [max_positions, head_dim]
            signed_sin_table = torch.cat((-sin, sin), dim=-1)
            self._tables[key] = (cos_table.to(device, dtype), signed_sin_table.to(device, dtype))
        return self._tables[key]


def rotate(heads: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate heads [T, H, D] by (cos, signed_sin) from `RotaryEmbedding.for_positions`.

    The rotate-half formula `x * cos + cat(-x2, x1) * sin`, with the negation in the table.
    """
    cos, signed_sin = rotation
    half = heads.shape[-1] // 2
    swapped = torch.cat((heads[..., half:], heads[..., :half]), dim=-1)
    return swapped.mul_(signed_sin).add_(heads * cos)
