"""Kernel tests: Triton's interpreter on CPU, compiled kernels on a CUDA machine.

Triton decides between compiling and interpreting when `@triton.jit` decorates a function, reading
TRITON_INTERPRET. That happens when a kernel module is imported, and also when `triton` itself is
first imported (`tl.zeros`, `tl.max`, ... are `@triton.jit` functions too). pytest imports every test
module and conftest of a run into one process, so exporting the variable here would leak into every
test collected after this directory: `get_attention_backend("triton")` on CPU would stop failing in
other components' tests depending on which tests ran. So:

1. the variable is set only while `triton` and the two kernel modules are imported, here, and the
   environment is then restored; nothing else is affected (`prefixcache.kernels` does not import
   Triton, and an interpreted `triton.language` is harmless to code that never launches a kernel);
2. the autouse fixture `_triton_interpreter` sets it again for the duration of each kernel test (the
   backend selector lets Triton run on CPU only while it is set), and monkeypatch removes it after.

If `triton` was already imported, compiled, by something collected before this directory (for
instance `from transformers import LlamaForCausalLM` imports it), it cannot be interpreted any more:
the Triton tests then fail with that explanation; run them in their own process
(`pytest tests/kernels`) or export TRITON_INTERPRET=1 for the whole run.
On a machine with CUDA (and no TRITON_INTERPRET of its own) the kernels stay compiled and the same
small tests run on the GPU: tests of Triton kernels take `triton_device` (CUDA there, else the CPU),
every other kernel test takes `device` and runs once per device (`tests/conftest.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from prefixcache.kernels import AttentionMetadata, paged_attention_reference, reshape_and_cache_reference
from prefixcache.kernels.backends import triton_runs_interpreted

INTERPRETED = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _import_triton_interpreted() -> bool:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return triton_runs_interpreted()
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


TRITON_USABLE = not INTERPRETED or _import_triton_interpreted()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def triton_kernels() -> None:
    """Requested by the tests that launch Triton kernels."""
    if not TRITON_USABLE:
        pytest.fail(
            "triton was imported, compiled, before tests/kernels/conftest.py could import it under its "
            "interpreter (no GPU here): run `pytest tests/kernels` on its own or export TRITON_INTERPRET=1"
        )


@pytest.fixture
def triton_device() -> torch.device:
    """Where the Triton kernels run in this process: the GPU when they are compiled, else the CPU."""
    return torch.device("cpu" if INTERPRETED else "cuda")


@dataclass
class PagedBatch:
    """One step of a packed batch over a randomly filled paged cache, with shuffled block tables."""

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's new keys
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def write_new_kv(self) -> AttentionMetadata:
        """The step's metadata, with this step's keys and values written into the cache (by the reference)."""
        meta = AttentionMetadata.build(self.query_lens, self.seq_lens, self.block_tables, self.block_size,
                                       self.query.device)
        reshape_and_cache_reference(self.key, self.value, self.key_cache, self.value_cache, meta.slot_mapping)
        return meta

    def reference_attention(self) -> torch.Tensor:
        """The plain-torch reference's attention output for this step (call after `write_new_kv`), computed
        on the CPU in float32 and returned on the batch's device, to compare like with like."""
        expected = paged_attention_reference(self.query.cpu(), self.key_cache.cpu(), self.value_cache.cpu(),
                                             self.query_lens, self.seq_lens, self.block_tables, self.scale)
        return expected.to(self.query.device)


def make_paged_batch(
    sequences: list[tuple[int, int]],  # (cached context length, new tokens) per sequence
    block_size: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    """Random inputs (never zeros) and block tables drawn from a shuffled pool with unused blocks in it.

    Block 0 is never handed out: table padding is 0, so a kernel that reads padding reads a spare block.
    """
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [context + new for context, new in sequences]
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = []
    for count in blocks_needed:
        block_tables.append(pool[:count])
        pool = pool[count:]
    num_tokens = sum(new for _, new in sequences)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        query_lens=[new for _, new in sequences],
        seq_lens=seq_lens,
        block_tables=block_tables,
        block_size=block_size,
        query=random(num_tokens, num_kv_heads * queries_per_kv, head_dim),
        key=random(num_tokens, num_kv_heads, head_dim),
        value=random(num_tokens, num_kv_heads, head_dim),
        key_cache=random(*cache_shape),
        value_cache=random(*cache_shape),
    )


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """`make_paged_batch`, for tests (a fixture, so they need not import this conftest); they name the device."""
    return make_paged_batch


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.fixture
def relative_error() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """||actual - expected|| / ||expected||, in float32 (a fixture so tests need not import this conftest)."""
    return _relative_error
