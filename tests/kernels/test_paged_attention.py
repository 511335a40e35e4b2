"""Paged attention: the Triton kernel and the torch CPU path against the plain-torch reference, and each other."""

from __future__ import annotations

import copy

import pytest
import torch

from prefixcache.kernels import AttentionMetadata, get_attention_backend, paged_attention_reference
from prefixcache.kernels.cpu.attention import (
    TorchAttentionPlan,
    _attend_context_prefill,
    _masked_context_prefill,
    _read_blocks,
    attend_torch,
)
from prefixcache.kernels.reference import reshape_and_cache_reference

# (queries per kv head, head_dim, block_size); two kv heads each. head_dim 24 exercises the kernel's padding.
SHAPES = [
    pytest.param(1, 16, 4, id="gqa1-d16-bs4"),
    pytest.param(3, 24, 8, id="gqa3-d24-bs8"),
]
# (cached context, new tokens) per sequence.
BATCHES = [
    pytest.param(
        [(0, 7), (9, 5), (12, 1), (5, 1), (0, 1), (3, 2)],
        id="mixed",  # fresh prefill, chunks on context, decodes (one opening a new block), a 1-token prompt
    ),
    pytest.param([(6, 1), (28, 1), (17, 1), (1, 1), (30, 1), (25, 1)], id="decodes"),  # some padded together
    pytest.param([(21, 19), (0, 18)], id="long-chunks"),  # several query tiles per sequence under GQA
]


def written(batch, device: torch.device) -> AttentionMetadata:
    """The step's metadata, with the new keys and values already in the cache (via the reference)."""
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, device)
    reshape_and_cache_reference(batch.key, batch.value, batch.key_cache, batch.value_cache, meta.slot_mapping)
    return meta


def reference_output(batch) -> torch.Tensor:
    return paged_attention_reference(
        batch.query.cpu(),
        batch.key_cache.cpu(),
        batch.value_cache.cpu(),
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )


@pytest.mark.parametrize("sequences", BATCHES)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_triton_kernel_matches_reference(
    triton_kernels, paged_batch, relative_error, device, sequences, queries_per_kv, head_dim, block_size
):
    from prefixcache.kernels.triton_ops.paged_attention import paged_attention

    batch = paged_batch(
        sequences, block_size=block_size, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=head_dim
    )
    meta = written(batch, device)
    output = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        batch.scale,
    )
    assert relative_error(output.cpu(), reference_output(batch)) < 1e-5


@pytest.mark.parametrize("sequences", BATCHES)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_torch_path_matches_reference(paged_batch, relative_error, sequences, queries_per_kv, head_dim, block_size):
    batch = paged_batch(
        sequences, block_size=block_size, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=head_dim
    )
    meta = written(batch, batch.query.device)
    plan = TorchAttentionPlan.build(meta, block_size)
    output = attend_torch(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, plan, batch.scale
    )
    assert relative_error(output.cpu(), reference_output(batch)) < 1e-5


@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_context_prefills_off_cpu_take_one_masked_call_with_the_same_result(paged_batch, relative_error,
                                                                           queries_per_kv):
    # The split path's flash kernel (it returns the log-sum-exp) exists on CPU only; other devices
    # attend context and chunk in one masked call. Both run here, on CPU, against the reference.
    batch = paged_batch([(9, 5), (21, 19), (4, 2)], block_size=4, num_kv_heads=2, queries_per_kv=queries_per_kv,
                        head_dim=16)
    meta = written(batch, batch.query.device)
    plan = TorchAttentionPlan.build(meta, 4)
    expected = reference_output(batch)
    assert len(plan.context_prefills) == 3
    for prefill in plan.context_prefills:
        rows = prefill.tokens
        context = slice(0, prefill.context_len)
        masked = _masked_context_prefill(
            batch.query[rows], batch.key[rows], batch.value[rows],
            _read_blocks(batch.key_cache, prefill.blocks, None)[context],
            _read_blocks(batch.value_cache, prefill.blocks, None)[context], batch.scale)
        split = _attend_context_prefill(batch.query[rows], batch.key[rows], batch.value[rows], batch.key_cache,
                                        batch.value_cache, prefill, batch.scale)
        assert relative_error(masked, expected[rows]) < 1e-5
        assert relative_error(split, expected[rows]) < 1e-5


def test_torch_path_matches_reference_in_bfloat16(paged_batch, relative_error):
    batch = paged_batch(
        [(0, 9), (11, 4), (7, 1), (20, 1)], block_size=4, num_kv_heads=2, queries_per_kv=3, head_dim=16,
        dtype=torch.bfloat16,
    )
    meta = written(batch, batch.query.device)
    output = get_attention_backend("torch").attend(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale
    )
    assert output.dtype == torch.bfloat16
    assert relative_error(output.cpu(), reference_output(batch)) < 2e-2


@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_triton_and_torch_backends_agree(triton_kernels, paged_batch, relative_error, device, queries_per_kv):
    """The full per-layer call sequence of each backend: write this step's K/V, then attend."""
    batch = paged_batch(
        [(0, 6), (10, 3), (4, 1), (13, 1)], block_size=4, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=16
    )
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, device)
    results = {}
    for name in ("triton", "torch"):
        backend = get_attention_backend(name, device)
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
    # Two decode groups with padding, partial last blocks, a chunk on context, a fresh prefill.
    sequences = [(0, 5), (6, 3), (2, 1), (9, 1), (7, 1), (21, 1), (19, 1)]
    batch = paged_batch(sequences, block_size=4, num_kv_heads=1, queries_per_kv=3, head_dim=16)
    meta = written(batch, device)
    owned = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for seq_len, table in zip(batch.seq_lens, batch.block_tables):
        for position in range(seq_len if backend_name != "torch" else len(table) * batch.block_size):
            owned[table[position // batch.block_size], position % batch.block_size] = True
    assert not owned[0].any()
    expected = reference_output(batch)
    batch.key_cache[~owned.to(device)] = float("nan")
    batch.value_cache[~owned.to(device)] = float("nan")
    output = get_attention_backend(backend_name, device).attend(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale
    )
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled Triton kernels at model size")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_backend_at_model_size_on_cuda(paged_batch, relative_error, device, dtype, tolerance):
    """SmolLM2's attention shape (9 query heads, 3 kv heads, head_dim 64), 16-token blocks, up to 1k context."""
    if device.type != "cuda":
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels are interpreted, too slow at model size")
    sequences = [(0, 300), (700, 324), (1023, 1), (511, 1), (64, 1), (250, 17)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=64, dtype=dtype)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, device)
    backend = get_attention_backend(None, device)
    assert backend.name == "triton"
    backend.write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, meta)
    output = backend.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale)
    assert relative_error(output.cpu(), reference_output(batch)) < tolerance


def test_torch_path_groups_decodes_of_similar_length(paged_batch):
    """Decodes of 31, 29 and 26 positions share one padded SDPA call; 4,000 and 2 positions get their own."""
    sequences = [(30, 1), (3999, 1), (28, 1), (1, 1), (25, 1)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=1, queries_per_kv=1, head_dim=8)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, "cpu")
    plan = TorchAttentionPlan.build(meta, batch.block_size)
    shapes = sorted((decodes.blocks.shape[0], decodes.max_len) for decodes in plan.decode_batches)
    assert shapes == [(1, 2), (1, 4000), (3, 31)]
    [padded] = [decodes for decodes in plan.decode_batches if decodes.visible is not None]
    assert padded.visible.sum(dim=-1).flatten().tolist() == [31, 29, 26]


@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_path_attends_shared_leading_blocks_once(paged_batch, relative_error, queries_per_kv, dtype, tolerance):
    """Decodes whose tables start with the same 16 blocks (a cached 256-token prompt) attend to them as a
    cascade: one call over the shared blocks, one over each sequence's own tail (padded, partial last
    blocks), merged. A decode with its own table and a fresh prefill ride in the same step."""
    sequences = [(300, 1), (270, 1), (333, 1), (290, 1), (100, 1), (0, 5)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=16,
                        dtype=dtype)
    for table in batch.block_tables[1:4]:
        table[:16] = batch.block_tables[0][:16]
    meta = written(batch, batch.query.device)
    plan = TorchAttentionPlan.build(meta, batch.block_size)
    [cascade] = plan.cascades
    assert cascade.shared_blocks.tolist() == batch.block_tables[0][:16]
    assert cascade.tails.token_index.tolist() == [2, 0, 3, 1]  # longest first
    assert [decodes.token_index.tolist() for decodes in plan.decode_batches] == [[4]]
    output = attend_torch(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, plan, batch.scale)
    assert output.dtype == dtype
    assert relative_error(output.cpu(), reference_output(batch)) < tolerance


def test_torch_path_skips_a_cascade_that_would_save_little(paged_batch):
    """Two decodes sharing 4 blocks of 16 would save reading 64 positions: not worth a cascade."""
    batch = paged_batch([(80, 1), (90, 1)], block_size=16, num_kv_heads=1, queries_per_kv=1, head_dim=8)
    batch.block_tables[1][:4] = batch.block_tables[0][:4]
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, "cpu")
    plan = TorchAttentionPlan.build(meta, batch.block_size)
    assert plan.cascades == [] and sum(d.blocks.shape[0] for d in plan.decode_batches) == 2


def test_torch_path_reads_consecutive_blocks_in_place_with_the_same_result(paged_batch, relative_error):
    """The same step with every sequence's blocks moved to consecutive ids: the lone decode, the chunk on
    cached context and the cascade's shared blocks are read as views of the cache instead of gathered
    copies, and the output is the same to the bit."""
    sequences = [(300, 1), (290, 1), (700, 1), (40, 9), (0, 5), (100, 1), (95, 1)]
    scattered = paged_batch(sequences, block_size=16, num_kv_heads=2, queries_per_kv=3, head_dim=16)
    scattered.block_tables[1][:16] = scattered.block_tables[0][:16]  # a shared 256-token prompt
    relocation: dict[int, int] = {}  # old block id -> new, in table order: each table's own blocks consecutive
    for table in scattered.block_tables:
        for block in table:
            relocation.setdefault(block, len(relocation) + 1)
    consecutive = copy.copy(scattered)
    consecutive.block_tables = [[relocation[block] for block in table] for table in scattered.block_tables]
    consecutive.key_cache, consecutive.value_cache = scattered.key_cache.clone(), scattered.value_cache.clone()
    old_ids, new_ids = torch.tensor(list(relocation)), torch.tensor(list(relocation.values()))
    consecutive.key_cache[new_ids] = scattered.key_cache[old_ids]
    consecutive.value_cache[new_ids] = scattered.value_cache[old_ids]

    outputs, plans = [], []
    for batch in (scattered, consecutive):
        plan = TorchAttentionPlan.build(written(batch, batch.query.device), batch.block_size)
        outputs.append(attend_torch(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache,
                                    plan, batch.scale))
        plans.append(plan)
    assert torch.equal(outputs[0], outputs[1])
    assert relative_error(outputs[1], reference_output(consecutive)) < 1e-5

    def views(plan: TorchAttentionPlan) -> list[int | None]:
        return ([prefill.first_block for prefill in plan.context_prefills]
                + [cascade.first_shared_block for cascade in plan.cascades]
                + sorted((d.first_block for d in plan.decode_batches), key=lambda block: block or 0))
    assert views(plans[0]) == [None, None, None, None]
    lone_decode, chunk, shared = (consecutive.block_tables[i][0] for i in (2, 3, 0))
    assert views(plans[1]) == [chunk, shared, None, lone_decode]  # the two-decode group is still gathered
