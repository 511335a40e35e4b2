"""Backend selection, and every backend's per-layer calls against the others and the reference."""

from __future__ import annotations

import pytest
import torch

from prefixcache.kernels import AttentionMetadata, get_attention_backend


@pytest.mark.parametrize("name", [None, "auto"])
def test_auto_picks_torch_on_cpu(name):
    assert get_attention_backend(name, "cpu").name == "torch"


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_named_backends_are_honoured_on_every_device(name, device):
    assert get_attention_backend(name, device).name == name


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch"):
        get_attention_backend("flash")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")


def test_triton_backend_where_triton_runs(triton_kernels, triton_device):
    assert get_attention_backend("triton", triton_device).name == "triton"


def test_interpreted_triton_refuses_bfloat16(triton_kernels, triton_device):
    """Triton's interpreter gets bfloat16 dot products wrong by orders of magnitude: say so instead."""
    if triton_device.type == "cuda":
        pytest.skip("compiled kernels run bfloat16 correctly")
    assert get_attention_backend("triton", triton_device, dtype=torch.float32).name == "triton"
    with pytest.raises(ValueError, match="interpreter computes bfloat16 dot products wrongly"):
        get_attention_backend("triton", triton_device, dtype=torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when no CUDA device exists")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        get_attention_backend(None, "cuda")


@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_triton_and_torch_backends_agree(triton_kernels, paged_batch, relative_error, triton_device, queries_per_kv):
    """The full per-layer call sequence of each backend: write this step's K/V, then attend."""
    batch = paged_batch([(0, 6), (10, 3), (4, 1), (13, 1)], block_size=4, num_kv_heads=2,
                        queries_per_kv=queries_per_kv, head_dim=16, device=triton_device)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size,
                                   triton_device)
    results = {}
    for name in ("triton", "torch"):
        backend = get_attention_backend(name, triton_device)
        key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
        backend.write_kv(batch.key, batch.value, key_cache, value_cache, meta)
        output = backend.attend(batch.query, batch.key, batch.value, key_cache, value_cache, meta, batch.scale)
        results[name] = (output, key_cache, value_cache)
    triton_output, triton_keys, triton_values = results["triton"]
    torch_output, torch_keys, torch_values = results["torch"]
    assert torch.equal(triton_keys, torch_keys) and torch.equal(triton_values, torch_values)
    assert not torch.equal(triton_keys, batch.key_cache)  # the write did happen
    assert relative_error(triton_output, torch_output) < 1e-5


@pytest.mark.parametrize("backend_name", ["torch", "triton", "reference"])
def test_blocks_outside_the_tables_are_never_read(request, paged_batch, device, backend_name):
    """NaN in every block no table holds (block 0, which table padding names, among them) stays out.

    The Triton kernel and the reference read exactly the positions below each sequence's length, so
    for them NaN also fills the unused tail of partial last blocks; the torch path may read those,
    masked out, in a padded decode group (it relies on cache slots holding finite values).
    """
    if backend_name == "triton":
        request.getfixturevalue("triton_kernels")
        if device != request.getfixturevalue("triton_device"):
            pytest.skip(f"Triton runs on {request.getfixturevalue('triton_device')} in this process")
    # Two decode groups with padding, partial last blocks, a chunk on context, a fresh prefill.
    sequences = [(0, 5), (6, 3), (2, 1), (9, 1), (7, 1), (21, 1), (19, 1)]
    batch = paged_batch(sequences, block_size=4, num_kv_heads=1, queries_per_kv=3, head_dim=16, device=device)
    meta = batch.write_new_kv()
    owned = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for seq_len, table in zip(batch.seq_lens, batch.block_tables):
        for position in range(seq_len if backend_name != "torch" else len(table) * batch.block_size):
            owned[table[position // batch.block_size], position % batch.block_size] = True
    assert not owned[0].any()
    expected = batch.reference_attention()
    batch.key_cache[~owned.to(device)] = float("nan")
    batch.value_cache[~owned.to(device)] = float("nan")
    output = get_attention_backend(backend_name, device).attend(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale
    )
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
