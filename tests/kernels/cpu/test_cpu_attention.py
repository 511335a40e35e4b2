"""The torch attention path (`cpu/attention.py`): writes and attention against the plain-torch reference."""

from __future__ import annotations

import copy

import pytest
import torch
from attention_batches import BATCHES, SHAPES

from prefixcache.kernels import AttentionMetadata, get_attention_backend, reshape_and_cache_reference
from prefixcache.kernels.cpu.attention import (
    _attend_context_prefill,
    _masked_context_prefill,
    _read_blocks,
    attend_torch,
)
from prefixcache.kernels.cpu.attention_plan import TorchAttentionPlan

CPU = torch.device("cpu")


@pytest.mark.parametrize("sequences", BATCHES)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_torch_path_matches_reference(paged_batch, relative_error, device, sequences, queries_per_kv, head_dim,
                                      block_size):
    batch = paged_batch(sequences, block_size=block_size, num_kv_heads=2, queries_per_kv=queries_per_kv,
                        head_dim=head_dim, device=device)
    meta = batch.write_new_kv()
    plan = TorchAttentionPlan.build(meta, block_size)
    output = attend_torch(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, plan, batch.scale
    )
    assert relative_error(output, batch.reference_attention()) < 1e-5


@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_context_prefills_off_cpu_take_one_masked_call_with_the_same_result(paged_batch, relative_error,
                                                                           queries_per_kv):
    # The split path's flash kernel (it returns the log-sum-exp) exists on CPU only; other devices
    # attend context and chunk in one masked call. Both run here, on CPU, against the reference.
    batch = paged_batch([(9, 5), (21, 19), (4, 2)], block_size=4, num_kv_heads=2, queries_per_kv=queries_per_kv,
                        head_dim=16, device=CPU)
    meta = batch.write_new_kv()
    plan = TorchAttentionPlan.build(meta, 4)
    expected = batch.reference_attention()
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


def test_torch_path_matches_reference_in_bfloat16(paged_batch, relative_error, device):
    batch = paged_batch([(0, 9), (11, 4), (7, 1), (20, 1)], block_size=4, num_kv_heads=2, queries_per_kv=3,
                        head_dim=16, dtype=torch.bfloat16, device=device)
    meta = batch.write_new_kv()
    output = get_attention_backend("torch", device, dtype=torch.bfloat16).attend(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, meta, batch.scale
    )
    assert output.dtype == torch.bfloat16
    assert relative_error(output, batch.reference_attention()) < 2e-2


@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_path_attends_shared_leading_blocks_once(paged_batch, relative_error, queries_per_kv, dtype, tolerance):
    """Decodes whose tables start with the same 16 blocks (a cached 256-token prompt) attend to them as a
    cascade: one call over the shared blocks, one over each sequence's own tail (padded, partial last
    blocks), merged. A decode with its own table and a fresh prefill ride in the same step. Cascades are
    planned on the CPU only (their merge needs the CPU flash kernel's log-sum-exp)."""
    sequences = [(300, 1), (270, 1), (333, 1), (290, 1), (100, 1), (0, 5)]
    batch = paged_batch(sequences, block_size=16, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=16,
                        dtype=dtype, device=CPU)
    for table in batch.block_tables[1:4]:
        table[:16] = batch.block_tables[0][:16]
    meta = batch.write_new_kv()
    plan = TorchAttentionPlan.build(meta, batch.block_size)
    [cascade] = plan.cascades
    assert cascade.shared_blocks.tolist() == batch.block_tables[0][:16]
    assert cascade.tails.token_index.tolist() == [2, 0, 3, 1]  # longest first
    assert [decodes.token_index.tolist() for decodes in plan.decode_batches] == [[4]]
    output = attend_torch(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, plan, batch.scale)
    assert output.dtype == dtype
    assert relative_error(output, batch.reference_attention()) < tolerance


def test_torch_path_reads_consecutive_blocks_in_place_with_the_same_result(paged_batch, relative_error):
    """The same step with every sequence's blocks moved to consecutive ids: the lone decode, the chunk on
    cached context and the cascade's shared blocks are read as views of the cache instead of gathered
    copies, and the output is the same to the bit. (On the CPU, where its plan includes cascades.)"""
    sequences = [(300, 1), (290, 1), (700, 1), (40, 9), (0, 5), (100, 1), (95, 1)]
    scattered = paged_batch(sequences, block_size=16, num_kv_heads=2, queries_per_kv=3, head_dim=16, device=CPU)
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
        plan = TorchAttentionPlan.build(batch.write_new_kv(), batch.block_size)
        outputs.append(attend_torch(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache,
                                    plan, batch.scale))
        plans.append(plan)
    assert torch.equal(outputs[0], outputs[1])
    assert relative_error(outputs[1], consecutive.reference_attention()) < 1e-5

    def views(plan: TorchAttentionPlan) -> list[int | None]:
        return ([prefill.first_block for prefill in plan.context_prefills]
                + [cascade.first_shared_block for cascade in plan.cascades]
                + sorted((d.first_block for d in plan.decode_batches), key=lambda block: block or 0))
    assert views(plans[0]) == [None, None, None, None]
    lone_decode, chunk, shared = (consecutive.block_tables[i][0] for i in (2, 3, 0))
    assert views(plans[1]) == [chunk, shared, None, lone_decode]  # the two-decode group is still gathered


def test_torch_write_path_matches_reference(paged_batch, device):
    batch = paged_batch([(0, 6), (9, 5), (12, 1)], block_size=4, num_kv_heads=3, queries_per_kv=1, head_dim=8,
                        device=device)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, batch.block_size, device)
    expected_keys, expected_values = batch.key_cache.clone(), batch.value_cache.clone()
    reshape_and_cache_reference(batch.key, batch.value, expected_keys, expected_values, meta.slot_mapping)
    get_attention_backend("torch", device).write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, meta)
    assert torch.equal(batch.key_cache, expected_keys)
    assert torch.equal(batch.value_cache, expected_values)
