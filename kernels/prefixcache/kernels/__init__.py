"""Paged KV cache and attention kernels: Triton for CUDA (`triton_ops`), a torch path for CPU with native
C++ kernels where they run (`cpu`), plain-torch references (`reference`).

Importing this package never imports Triton: the Triton kernel modules (`triton_ops.paged_attention`,
`triton_ops.reshape_and_cache`) load only when the Triton backend is asked for, because `@triton.jit`
decides at import time whether to compile or interpret (`TRITON_INTERPRET=1`).
"""

from prefixcache.kernels.backends import (
    BACKEND_NAMES,
    AttentionBackend,
    ReferenceAttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
    get_attention_backend,
)
from prefixcache.kernels.metadata import AttentionMetadata
from prefixcache.kernels.paged_kv import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    num_blocks_for_budget,
)
from prefixcache.kernels.reference import paged_attention_reference, reshape_and_cache_reference

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "ReferenceAttentionBackend",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "allocate_kv_cache",
    "get_attention_backend",
    "kv_cache_bytes_per_block",
    "kv_cache_shape",
    "num_blocks_for_budget",
    "paged_attention_reference",
    "reshape_and_cache_reference",
]
