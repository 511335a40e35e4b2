"""Attention backends behind one interface, and the choice between them.

- `torch`: gather + SDPA (`cpu.attention`, planned per step by `cpu.attention_plan`), the serving
  path on CPU, with prefills and decodes in the native CPU kernels where they run (`cpu.native`);
- `triton`: the Triton kernels, the serving path on CUDA;
- `reference`: the plain-torch references, slow, for tests and debugging.

`get_attention_backend(None | "auto", device)` picks Triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from prefixcache.kernels.cpu.attention import attend_torch, write_kv_torch
from prefixcache.kernels.cpu.attention_plan import TorchAttentionPlan
from prefixcache.kernels.cpu.decode_staging import DecodeStaging
from prefixcache.kernels.cpu.native import NativeCpuKernels, native_cpu_kernels
from prefixcache.kernels.metadata import AttentionMetadata
from prefixcache.kernels.reference import paged_attention_reference, reshape_and_cache_reference

BACKEND_NAMES = ("auto", "torch", "triton", "reference")


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        key: torch.Tensor,  # this step's keys, [num_tokens, num_kv_heads, head_dim], already written
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_q_heads, head_dim]


class _CheckedBackend:
    """Validates shapes once for every backend, then hands over to the backend's own kernels."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        check_kv_shapes(key, value, key_cache, value_cache, meta)
        self._write_kv(key, value, key_cache, value_cache, meta.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        check_query_shape(query, key_cache, meta)
        return self._attend(query, key, value, key_cache, value_cache, meta, scale)

    def _write_kv(self, key, value, key_cache, value_cache, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def _attend(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(_CheckedBackend):
    name = "torch"

    def __init__(self, staging: DecodeStaging | None = None,
                 native: NativeCpuKernels | None = None) -> None:
        # Decode groups' keys and values kept between steps (none by default): one backend per cache.
        self._staging = staging
        self._native = native

    def _write_kv(self, key, value, key_cache, value_cache, slot_mapping):
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping)

    def _attend(self, query, key, value, key_cache, value_cache, meta, scale):
        block_size = key_cache.shape[1]
        native = self._native if self._native and self._native.runs_attention(query, key_cache) else None
        plan_key = (self.name, block_size, native is not None)  # the plan differs with and without the kernels
        plan = meta.backend_cache.get(plan_key)
        if plan is None:
            plan = meta.backend_cache[plan_key] = TorchAttentionPlan.build(meta, block_size, self._staging,
                                                                           native=native is not None)
        return attend_torch(query, key, value, key_cache, value_cache, plan, scale, native)


class ReferenceAttentionBackend(_CheckedBackend):
    name = "reference"

    def _write_kv(self, key, value, key_cache, value_cache, slot_mapping):
        reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)

    def _attend(self, query, key, value, key_cache, value_cache, meta, scale):
        return paged_attention_reference(
            query, key_cache, value_cache, meta.query_lens_list, meta.seq_lens_list, meta.block_tables.tolist(), scale
        )


class TritonAttentionBackend(_CheckedBackend):
    name = "triton"

    def __init__(self) -> None:
        # Imported here so that CPU-only processes never decorate the kernels (see `get_attention_backend`).
        from prefixcache.kernels.triton_ops.paged_attention import paged_attention
        from prefixcache.kernels.triton_ops.reshape_and_cache import reshape_and_cache

        self._paged_attention = paged_attention
        self._reshape_and_cache = reshape_and_cache

    def _write_kv(self, key, value, key_cache, value_cache, slot_mapping):
        self._reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def _attend(self, query, key, value, key_cache, value_cache, meta, scale):
        return self._paged_attention(
            query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, max(meta.seq_lens_list),
        )


def get_attention_backend(name: str | None = None, device: torch.device | str = "cpu",
                          decode_staging_positions: int = 0, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend called `name` for `dtype` tensors on `device`; `None` or "auto" picks Triton on CUDA,
    else torch.

    `decode_staging_positions` lets the torch backend keep decode groups' keys and values between
    steps, that many positions per layer at most (see `decode_staging`); other backends read the
    paged cache in place and ignore it."""
    device = torch.device(device)
    if name is None or name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        staging = DecodeStaging(decode_staging_positions) if decode_staging_positions else None
        native = native_cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
        return TorchAttentionBackend(staging, native)
    if name == "reference":
        return ReferenceAttentionBackend()
    if name == "triton":
        _check_triton_usable(device, dtype)
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def _triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_triton_usable(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("attention backend 'triton' was asked for on CUDA, but no CUDA device is available")
        return
    if not _triton_interpreter_enabled():
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device, got {device.type!r}; use 'torch' on CPU "
            "(or set TRITON_INTERPRET=1 before importing the kernels, for tests: it is very slow)"
        )
    if not triton_runs_interpreted():
        raise ValueError(
            "TRITON_INTERPRET=1 is set, but triton was imported before it was: its kernels are compiled for "
            "a GPU and cannot run on CPU"
        )
    if dtype == torch.bfloat16:  # the interpreter of Triton 3.7 and 3.9: a 16x16 bf16 tl.dot is off by 1e10
        raise ValueError("Triton's interpreter computes bfloat16 dot products wrongly; use float32 with it, "
                         "or the 'torch' backend on CPU")


def triton_runs_interpreted() -> bool:
    """Whether Triton and our kernels were decorated for the interpreter (imports them if need be)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from prefixcache.kernels.triton_ops.paged_attention import _paged_attention_kernel
    from prefixcache.kernels.triton_ops.reshape_and_cache import _reshape_and_cache_kernel
    from prefixcache.kernels.triton_ops.split_kv import _merge_kv_splits_kernel

    # tl.zeros stands for triton.language's own @triton.jit helpers, decorated when triton is imported.
    return all(
        isinstance(function, InterpretedFunction)
        for function in (tl.zeros, _paged_attention_kernel, _reshape_and_cache_kernel, _merge_kv_splits_kernel)
    )


def check_kv_shapes(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [num_tokens, heads, dim]")
    if key.shape[0] != meta.num_tokens:
        raise ValueError(f"key has {key.shape[0]} tokens but meta.slot_mapping has {meta.num_tokens}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must be "
            f"[num_blocks, block_size, {key.shape[1]}, {key.shape[2]}]"
        )


def check_query_shape(query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    if query.dim() != 3 or query.shape[0] != meta.num_tokens or query.shape[2] != key_cache.shape[3]:
        raise ValueError(
            f"query {tuple(query.shape)} must be [{meta.num_tokens}, num_q_heads, {key_cache.shape[3]}]"
        )
    if query.shape[1] % key_cache.shape[2] != 0:
        raise ValueError(
            f"query has {query.shape[1]} heads, not a multiple of the cache's {key_cache.shape[2]} kv heads"
        )
