"""The native CPU attention (`cpu/prefill_attention.cpp`, `cpu/decode_attention.cpp`) against the plain-torch
reference.

Skipped only where the kernel cannot run by design (no AVX-512): on a machine that has it, a kernel
that fails to build fails these tests rather than hiding behind the torch fallback.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prefixcache.kernels import get_attention_backend
from prefixcache.kernels.cpu.native import DISABLE_ENV, native_cpu_kernels

pytestmark = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                reason="the native prefill attention needs AVX-512")
CPU = torch.device("cpu")


@pytest.fixture
def paged_batch(paged_batch):
    """Batches on the CPU: these kernels are CPU kernels, also on a machine that has CUDA."""
    return functools.partial(paged_batch, device=CPU)


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.prefill_attention


# (cached context, new tokens), kv heads, query heads per kv head, head_dim, block_size
CASES = [
    pytest.param((0, 2), 3, 3, 64, 16, id="two-tokens"),
    pytest.param((0, 97), 3, 3, 64, 16, id="fresh-two-items"),  # 96 rows per item under GQA 3
    pytest.param((992, 50), 3, 3, 64, 16, id="chunk-after-992"),  # items of 96 and 54 -> 64 rows
    pytest.param((40, 26), 3, 3, 64, 16, id="78-rows"),  # a full register block, then one of two vectors
    pytest.param((61, 70), 2, 4, 128, 4, id="d128-gqa4-bs4"),
    pytest.param((17, 33), 4, 1, 64, 1, id="mha-bs1"),
    pytest.param((5, 130), 1, 12, 128, 32, id="gqa12-bs32"),
]


@pytest.mark.parametrize("sequence,num_kv_heads,queries_per_kv,head_dim,block_size", CASES)
def test_matches_the_reference(kernel, paged_batch, relative_error, sequence, num_kv_heads, queries_per_kv, head_dim,
                               block_size):
    batch = paged_batch([sequence], block_size=block_size, num_kv_heads=num_kv_heads, queries_per_kv=queries_per_kv,
                        head_dim=head_dim)
    batch.write_new_kv()
    blocks = torch.tensor(batch.block_tables[0], dtype=torch.int64)
    out = kernel(batch.query, batch.key_cache, batch.value_cache, blocks, batch.seq_lens[0], batch.scale)
    assert relative_error(out, batch.reference_attention()) < 2e-6


def test_strided_queries(kernel, paged_batch, relative_error):
    """Queries are views into the fused QKV projection: rows farther apart than the heads span."""
    batch = paged_batch([(20, 40)], block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    batch.write_new_kv()
    padded = torch.zeros(40, 9 + 6, 64)
    padded[:, :9] = batch.query
    blocks = torch.tensor(batch.block_tables[0], dtype=torch.int64)
    out = kernel(padded[:, :9], batch.key_cache, batch.value_cache, blocks, batch.seq_lens[0], batch.scale)
    assert relative_error(out, batch.reference_attention()) < 2e-6


def test_a_row_does_not_depend_on_how_the_prompt_was_chunked(kernel, paged_batch):
    """Cold, in one chunk, or after 48 cached positions: the same bits, so a cache hit changes nothing."""
    batch = paged_batch([(0, 150)], block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    batch.write_new_kv()
    blocks = torch.tensor(batch.block_tables[0], dtype=torch.int64)
    args = (batch.key_cache, batch.value_cache, blocks)
    whole = kernel(batch.query, *args, 150, batch.scale)
    for cut in (48, 101, 148):
        tail = kernel(batch.query[cut:], *args, 150, batch.scale)
        head = kernel(batch.query[:cut], *args, cut, batch.scale)
        assert torch.equal(torch.cat([head, tail]), whole), cut


def test_the_torch_backend_sends_prefills_and_decodes_to_them(kernel, paged_batch, relative_error):
    """A mixed step: fresh prefills, chunks after context and decodes go native."""
    sequences = [(0, 37), (40, 25), (30, 1), (64, 1), (0, 1)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    meta = batch.write_new_kv()
    backend = get_attention_backend("torch", CPU)
    out = backend.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale)
    plan = meta.backend_cache[("torch", 16, True)]
    assert [prefill.seq_len for prefill in plan.native_prefills] == [37, 65]
    assert plan.native_decodes.seq_lens.tolist() == [31, 65] and not plan.decode_batches
    assert len(plan.fresh_prefills) == 1 and not plan.context_prefills  # the one-token prompt
    assert relative_error(out, batch.reference_attention()) < 2e-6


def test_head_dims_it_does_not_cover_stay_on_the_torch_path(kernel, paged_batch, relative_error):
    batch = paged_batch([(0, 20), (12, 9), (30, 1)], block_size=8, num_kv_heads=2, queries_per_kv=3, head_dim=32)
    meta = batch.write_new_kv()
    backend = get_attention_backend("torch", CPU)
    out = backend.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale)
    plan = meta.backend_cache[("torch", 8, False)]
    assert not plan.native_prefills and len(plan.fresh_prefills) == len(plan.context_prefills) == 1
    assert plan.native_decodes is None and len(plan.decode_batches) == 1
    assert relative_error(out, batch.reference_attention()) < 2e-6


def test_more_than_16_queries_per_kv_head_stay_on_the_torch_path(kernel, paged_batch, relative_error):
    """The decode kernel keeps a kv head's queries in registers, 16 at most: wider groups fall back."""
    batch = paged_batch([(0, 9), (20, 1)], block_size=16, num_kv_heads=1, queries_per_kv=32, head_dim=64)
    meta = batch.write_new_kv()
    backend = get_attention_backend("torch", CPU)
    out = backend.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale)
    assert ("torch", 16, False) in meta.backend_cache
    assert relative_error(out, batch.reference_attention()) < 2e-6


def test_bad_arguments_are_refused_not_read(kernels, paged_batch):
    """Block ids outside the cache, or caches that do not match the query, raise before any read."""
    batch = paged_batch([(20, 4)], block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    blocks = torch.tensor(batch.block_tables[0])
    out = torch.empty_like(batch.query)
    for bad_block in (-1, batch.key_cache.shape[0], 10**8):
        bad = blocks.clone()
        bad[-1] = bad_block
        with pytest.raises(RuntimeError, match="outside the cache"):
            kernels.prefill_attention(batch.query, batch.key_cache, batch.value_cache, bad, 24, 0.1, out)
        with pytest.raises(RuntimeError, match="outside the cache"):
            kernels.decode_attention(batch.query, torch.tensor([0]), batch.key_cache, batch.value_cache, bad[None],
                                     torch.tensor([24]), 0.1, out)
    with pytest.raises(RuntimeError, match="caches: contiguous and alike"):
        kernels.prefill_attention(batch.query, batch.key_cache, batch.value_cache[:, :, :, :32].contiguous(), blocks,
                                  24, 0.1, out)
    with pytest.raises(RuntimeError, match="the cache's head_dim"):
        kernels.prefill_attention(batch.query, batch.key_cache[..., :32].contiguous(),
                                  batch.value_cache[..., :32].contiguous(), blocks, 24, 0.1, out)


def test_a_nan_in_the_cache_shows_in_the_output(kernels, paged_batch):
    """As with torch's kernels: corrupt keys must not be silently averaged away."""
    batch = paged_batch([(30, 2)], block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    batch.write_new_kv()
    batch.key_cache[batch.block_tables[0][1], 3, 0, 5] = float("nan")  # position 19, kv head 0
    blocks = torch.tensor(batch.block_tables[0])
    prefill = kernels.prefill_attention(batch.query, batch.key_cache, batch.value_cache, blocks, 32, batch.scale)
    decode = torch.zeros_like(batch.query)
    kernels.decode_attention(batch.query, torch.tensor([1]), batch.key_cache, batch.value_cache, blocks[None],
                             torch.tensor([32]), batch.scale, decode)
    for attended in (prefill, decode[1:]):
        assert attended[:, :3].isnan().all() and not attended[:, 3:].isnan().any()  # only kv head 0's queries


@pytest.mark.parametrize("switch", ["0", "off", "False"])
def test_it_can_be_switched_off(monkeypatch, switch):
    monkeypatch.setenv(DISABLE_ENV, switch)
    native_cpu_kernels.cache_clear()
    try:
        assert native_cpu_kernels() is None
    finally:
        monkeypatch.undo()
        native_cpu_kernels.cache_clear()
    assert native_cpu_kernels() is not None


def _decode(kernels, batch) -> torch.Tensor:
    """Every sequence of `batch` (one new token each) through the decode kernel."""
    width = max(len(table) for table in batch.block_tables)
    tables = torch.tensor([table + [0] * (width - len(table)) for table in batch.block_tables])
    out = torch.full_like(batch.query, float("nan"))
    kernels.decode_attention(batch.query, torch.arange(len(batch.seq_lens)), batch.key_cache, batch.value_cache,
                             tables, torch.tensor(batch.seq_lens), batch.scale, out)
    return out


# Positions per decode: one, a block and its neighbours, and past the kernel's 512-position splits.
@pytest.mark.parametrize("num_kv_heads,queries_per_kv,head_dim,block_size", [
    pytest.param(3, 3, 64, 16, id="smollm"),
    pytest.param(2, 4, 128, 8, id="d128-gqa4"),
    pytest.param(4, 1, 64, 1, id="mha-bs1"),
    pytest.param(1, 16, 64, 32, id="gqa16"),
])
def test_decodes_match_the_reference(kernels, paged_batch, relative_error, num_kv_heads, queries_per_kv, head_dim,
                                     block_size):
    sequences = [(0, 1), (14, 1), (15, 1), (16, 1), (511, 1), (512, 1), (1100, 1)]
    batch = paged_batch(sequences, block_size=block_size, num_kv_heads=num_kv_heads, queries_per_kv=queries_per_kv,
                        head_dim=head_dim)
    batch.write_new_kv()
    assert relative_error(_decode(kernels, batch), batch.reference_attention()) < 2e-6


def test_a_decode_does_not_depend_on_the_rest_of_the_batch(kernels, paged_batch):
    batch = paged_batch([(700, 1), (40, 1), (1030, 1)], block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    batch.write_new_kv()
    together = _decode(kernels, batch)
    batch.query, batch.block_tables, batch.seq_lens = batch.query[2:], batch.block_tables[2:], batch.seq_lens[2:]
    assert torch.equal(_decode(kernels, batch), together[2:])


def test_decode_rows_outside_the_batch_are_refused(kernels, paged_batch):
    batch = paged_batch([(20, 1)], block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64)
    tables = torch.tensor([batch.block_tables[0]])
    with pytest.raises(RuntimeError, match="a row outside the batch"):
        kernels.decode_attention(batch.query, torch.tensor([5]), batch.key_cache, batch.value_cache, tables,
                                 torch.tensor([21]), batch.scale, torch.empty_like(batch.query))
    with pytest.raises(RuntimeError, match="more positions than its table holds"):
        kernels.decode_attention(batch.query, torch.tensor([0]), batch.key_cache, batch.value_cache, tables,
                                 torch.tensor([200]), batch.scale, torch.empty_like(batch.query))
