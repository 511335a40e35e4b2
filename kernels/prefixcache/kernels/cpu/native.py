"""The native CPU kernels (`cpu/*.cpp`): built once per machine, then loaded.

The first process that asks builds them with torch's extension builder (tens of seconds)
into `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), which later processes reuse; a
file lock there keeps concurrent builders apart. Building needs a C++ compiler and ninja (the
`worker` extra installs ninja). Where they cannot run (no AVX-512, a failed build, or
`PREFIXCACHE_NATIVE_KERNELS` set to 0, false, no or off), `native_cpu_kernels()` says why in the log
once and returns None, and torch's own kernels serve, a little slower. They cover float32 only.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

_log = logging.getLogger(__name__)

DISABLE_ENV = "PREFIXCACHE_NATIVE_KERNELS"
SOURCE_DIR = Path(__file__).parent
SOURCES = [SOURCE_DIR / name for name in
           ("module.cpp", "prefill_attention.cpp", "decode_attention.cpp", "rms_norm.cpp", "elementwise.cpp",
            "few_row_linear.cpp", "few_row_blocks.cpp")]
ATTENTION_HEAD_DIMS = (64, 128)
MAX_QUERIES_PER_KV_HEAD = 16  # the decode kernel's register budget


@dataclass(frozen=True)
class NativeCpuKernels:
    module: ModuleType

    @staticmethod
    def runs_attention(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether the attention kernels take these shapes (else torch's kernels serve them)."""
        heads, head_dim = query.shape[-2:]
        return (query.device.type == "cpu" and query.dtype == torch.float32 and head_dim in ATTENTION_HEAD_DIMS
                and query.stride(-1) == 1 and query.stride(-2) == head_dim
                and heads // key_cache.shape[2] <= MAX_QUERIES_PER_KV_HEAD)

    def prefill_attention(
        self,
        query: torch.Tensor,  # [query_len, num_q_heads, D]: the chunk's queries, the last of the sequence
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D], the chunk's keys already in it
        value_cache: torch.Tensor,
        blocks: torch.Tensor,  # [>= ceil(seq_len / block_size)] int64: the sequence's blocks in order
        seq_len: int,
        scale: float,
        out: torch.Tensor | None = None,  # where to write (contiguous), else a new tensor
    ) -> torch.Tensor:  # [query_len, num_q_heads, D]
        """Causal attention of one sequence's prefill chunk, reading keys and values through its block table."""
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype)
        self.module.prefill_attention(query, key_cache, value_cache, blocks, seq_len, scale, out)
        return out

    def decode_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, D]: the whole step's queries (rows may be strided)
        token_rows: torch.Tensor,  # [num_decodes] int64: each decode's row
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_decodes, width] int64
        seq_lens: torch.Tensor,  # [num_decodes] int64: positions each decode attends to, its own included
        scale: float,
        out: torch.Tensor,  # [num_tokens, num_q_heads, D] contiguous: the decodes' rows are written
    ) -> None:
        """Attention of one new query per sequence over its paged keys and values, read in place."""
        self.module.decode_attention(query, token_rows, key_cache, value_cache, block_tables, seq_lens, scale, out)

    def rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(hidden) * weight, a new tensor (contiguous float32 in)."""
        return self.module.rms_norm(hidden, weight, eps)

    def add_rms_norm_(self, hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """residual += hidden, then hidden = rms_norm(residual) * weight; both in place (contiguous float32)."""
        self.module.add_rms_norm_(hidden, residual, weight, eps)
        return hidden

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for `gate_up` = [gate | up] on the last axis ([T, 2I] contiguous float32), as a
        new contiguous [T, I]."""
        return self.module.silu_and_mul(gate_up)

    def pack_few_row_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear layer's float32 weight [out, in], packed once for `few_row_linear`."""
        return self.module.pack_few_row_weight(weight)

    def pack_few_row_blocks(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The same weight as exact 4-bit, else 8-bit blocks (a fifth or a quarter of the bytes), for
        `few_row_linear`; None unless every weight is reproduced to the bit (`cpu/few_row_blocks.cpp`)."""
        return self.module.pack_few_row_blocks(weight)

    def few_row_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """x [at most 128 rows, in] (rows contiguous) @ weight.T + bias, from `pack_few_row_weight(weight)`
        or `pack_few_row_blocks(weight)`: the same bits either way."""
        return self.module.few_row_linear(x, packed, out_features, bias)

    def rotate_(self, heads: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`rotary.rotate` in place, to the bit: heads [T, H, D] float32 (rows may be strided)."""
        self.module.rotate_(heads, cos, signed_sin)
        return heads


@functools.cache
def native_cpu_kernels() -> NativeCpuKernels | None:
    """The kernels, built if need be; None (logged once) where they cannot run here."""
    switch = os.environ.get(DISABLE_ENV, "1")
    if switch.strip().lower() in ("0", "false", "no", "off"):
        _log.info("native CPU kernels disabled by %s=%s", DISABLE_ENV, switch)
        return None
    if sys.platform != "linux" or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        _log.info("the native CPU kernels need AVX-512 on Linux; using torch's kernels")
        return None
    try:
        module = _build()
    except Exception as error:  # a missing compiler or ninja, a failed build: serve without them
        message = str(error).strip()
        _log.warning("could not build the native CPU kernels (%s); using torch's kernels",
                     message.splitlines()[-1] if message else type(error).__name__)
        return None
    if not module.supported():
        _log.info("the native CPU kernels need AVX-512; using torch's kernels")
        return None
    _log.info("native CPU kernels ready (float32: attention, RMSNorm, SwiGLU, rotary)")
    return NativeCpuKernels(module)


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    # OpenMP for at::parallel_for; the extension shares torch's own libgomp (same soname, loaded first).
    # No implicit fused multiply-adds: the kernels say where they want one, and elsewhere keep torch's rounding.
    return load(name=f"prefixcache_cpu_kernels_{_source_digest()}", sources=[str(source) for source in SOURCES],
                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"], verbose=False)


def _source_digest() -> str:
    """Names the build after every source and header: torch's builder notices changed sources, not headers."""
    digest = hashlib.sha256()
    for path in sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH, which holds a virtualenv's own (the `ninja` package)
    only while the virtualenv is activated."""
    try:
        import ninja
    except ImportError:
        return  # then it must be on PATH already
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, path]))


def report() -> None:
    """Build the kernels now (setup, image builds) and say whether they run here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = native_cpu_kernels() is not None
    print("native CPU kernels:", "ready" if ready else "not available here, torch's kernels serve")
