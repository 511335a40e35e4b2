"""Split-KV attention: how many programs share one tile's keys, and the merge of their partial results.

A decode is one query row per head, so the paged attention grid (sequences x query tiles x kv heads)
is tiny for a small batch: one SmolLM2 decode is 3 programs, each walking the whole context alone,
on a GPU with a hundred or more streaming multiprocessors (SMs). Splitting each tile's keys into
`kv_splits` ranges multiplies the programs; each writes its unnormalised output with its running max
and sum (base 2), and the merge rescales them to a common max:

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,    M = max_s m_s

A split that saw no key of a row has m_s = -inf and weighs 0; the first split always holds position
0, which every query sees, so M is finite. On CPU (Triton's interpreter) nothing is split unless asked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# A split reads at least this many keys: below it the partial writes and the merge cost more than the
# extra programs gain.
MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 16  # a power of two, as every split count is (each one compiles the kernel once)


def choose_kv_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Splits for a grid of `num_programs` over sequences of at most `max_seq_len` keys, on `device`."""
    if device.type != "cuda":
        return 1
    return kv_splits_for(num_programs, max_seq_len, multiprocessor_count(device.index))


def kv_splits_for(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """The smallest power of two that gives every SM a program, within `MAX_KV_SPLITS` and no fewer
    than `MIN_KEYS_PER_SPLIT` keys per split of the longest sequence. A grid that already fills the
    GPU (a long prefill, a large batch) or short contexts get 1: no split, no merge."""
    splits = 1
    while (splits < MAX_KV_SPLITS and num_programs * splits < num_sms
           and max_seq_len >= 2 * splits * MIN_KEYS_PER_SPLIT):
        splits *= 2
    return splits


@functools.cache
def multiprocessor_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(torch.device("cuda", device_index)).multi_processor_count


@dataclass(frozen=True)
class PartialResults:
    """Per (token, query head, split): the unnormalised output, running max and sum, all float32."""

    splits: int
    output: torch.Tensor  # [num_tokens, num_q_heads, splits, head_dim]
    max: torch.Tensor  # [num_tokens, num_q_heads, splits]
    sum: torch.Tensor  # [num_tokens, num_q_heads, splits]

    @classmethod
    def allocate(cls, num_tokens: int, num_q_heads: int, splits: int, head_dim: int, device: torch.device,
                 placeholder: torch.Tensor) -> PartialResults:
        """Buffers for `splits` > 1; with one split the kernel writes the output directly and
        `placeholder` (any tensor on the device) stands in for the unused pointers."""
        if splits == 1:
            return cls(1, placeholder, placeholder, placeholder)
        rows = (num_tokens, num_q_heads, splits)
        return cls(splits, torch.empty((*rows, head_dim), dtype=torch.float32, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device))


@triton.jit
def _merge_kv_splits_kernel(
    output_ptr,  # [num_tokens, num_q_heads, head_dim]
    partial_output_ptr,  # [num_tokens, num_q_heads, KV_SPLITS, HEAD_DIM] float32
    partial_max_ptr,  # [num_tokens, num_q_heads, KV_SPLITS] float32
    partial_sum_ptr,  # [num_tokens, num_q_heads, KV_SPLITS] float32
    stride_output_token,
    stride_output_head,
    num_q_heads,
    KV_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    # One program merges one query head of one token.
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, KV_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row = (token.to(tl.int64) * num_q_heads + head) * KV_SPLITS + splits
    split_max = tl.load(partial_max_ptr + row)
    split_sum = tl.load(partial_sum_ptr + row)
    split_output = tl.load(partial_output_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=dim_valid[None, :],
                           other=0.0)
    weights = tl.exp2(split_max - tl.max(split_max, axis=0))  # [KV_SPLITS]; an empty split's is 0
    output = tl.sum(split_output * weights[:, None], axis=0) / tl.sum(split_sum * weights, axis=0)
    tl.store(output_ptr + token * stride_output_token + head * stride_output_head + dims,
             output.to(output_ptr.dtype.element_ty), mask=dim_valid)


def merge_kv_splits(partials: PartialResults, output: torch.Tensor) -> None:
    """Write the merged attention of every token and query head into `output`, in place."""
    num_tokens, num_q_heads, head_dim = output.shape
    _merge_kv_splits_kernel[(num_tokens, num_q_heads)](
        output,
        partials.output,
        partials.max,
        partials.sum,
        output.stride(0),
        output.stride(1),
        num_q_heads,
        KV_SPLITS=partials.splits,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
