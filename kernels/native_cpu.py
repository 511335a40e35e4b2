"""The native CPU kernel (`cpu/prefill_attention.cpp`): built once per machine, then loaded.

The first process that asks builds it with torch's extension builder (about 25 s on two cores) into
`$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), which later processes reuse; a file
lock there keeps concurrent builders apart. It needs a C++ compiler and ninja (the `worker` extra
installs ninja). Where it cannot run (no AVX-512, a build that fails, `PREFIXCACHE_NATIVE_KERNELS=0`),
`prefill_attention_kernel()` says why in the log once and returns None: the torch path then serves,
a little slower.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

_log = logging.getLogger(__name__)

DISABLE_ENV = "PREFIXCACHE_NATIVE_KERNELS"
SOURCE = Path(__file__).parent / "cpu" / "prefill_attention.cpp"
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class PrefillAttentionKernel:
    """Causal attention of one sequence's prefill chunk, reading keys and values through its block table."""

    module: ModuleType

    @staticmethod
    def supports(query: torch.Tensor) -> bool:
        return query.device.type == "cpu" and query.dtype == torch.float32 and query.shape[-1] in HEAD_DIMS

    def __call__(
        self,
        query: torch.Tensor,  # [query_len, num_q_heads, D]: the chunk's queries, the last of the sequence
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D], the chunk's keys already in it
        value_cache: torch.Tensor,
        blocks: torch.Tensor,  # [>= ceil(seq_len / block_size)] int64: the sequence's blocks in order
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:  # [query_len, num_q_heads, D]
        return self.module.prefill_attention(query, key_cache, value_cache, blocks, seq_len, scale)


@functools.cache
def prefill_attention_kernel() -> PrefillAttentionKernel | None:
    """The kernel, built if need be; None (logged once) where it cannot run here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        _log.info("native CPU kernels disabled by %s=0", DISABLE_ENV)
        return None
    if sys.platform != "linux" or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        _log.info("native CPU prefill attention needs AVX-512 on Linux; using torch's kernels")
        return None
    try:
        module = _build()
    except Exception as error:  # a missing compiler or ninja, a failed build: serve without it
        _log.warning("could not build the native CPU prefill attention (%s); using torch's kernels",
                     str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
        return None
    return PrefillAttentionKernel(module) if module.supported() else None


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    # OpenMP for at::parallel_for; the extension shares torch's own libgomp (same soname, loaded first).
    return load(name="prefixcache_prefill_attention", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)



def report() -> None:
    """Build the kernel now (setup, image builds) and say whether it runs here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = prefill_attention_kernel() is not None
    print("native CPU prefill attention:", "ready" if ready else "not available here, torch's kernels serve")
