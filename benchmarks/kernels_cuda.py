"""The Triton kernels on a CUDA GPU: checked against the plain-torch reference, then timed against torch SDPA.

Run by hand on a machine with a GPU: `python benchmarks/kernels_cuda.py`. Exits 1 without CUDA, and 2
when a check fails. `--device cpu` runs the checks under Triton's interpreter instead (float32 only,
the cases of at most `INTERPRETED_MAX_TOKENS` new tokens, no timings: the interpreter takes
milliseconds per program), which is how `scripts/gpu_check.sh` runs on a machine without a GPU.

Checks, per case: `reshape_and_cache` must write exactly the reference's slots; attention as the
backend runs it (its own choice of key splits) and forced to 4 splits must match the reference.
Timing columns, per layer (medians, ms, `triton.testing.do_bench`):
- `triton write`: `reshape_and_cache` of the step's new keys and values;
- `triton attend`: the paged attention kernel, splitting the keys as it chooses;
- `unsplit`: the same kernel with one program per query tile and kv head;
- `torch paged`: the torch backend (gather over the block table + SDPA) on the same GPU;
- `dense SDPA`: SDPA over contiguous, unpaged tensors of the same sizes, the bar to reach.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from attention_cases import CASES, Case, LayerInputs, dense_sdpa, make_inputs, print_table

from prefixcache.kernels import get_attention_backend, paged_attention_reference, reshape_and_cache_reference

MIXED = Case("mixed batch", [(0, 300), (700, 324), (1023, 1), (511, 1), (64, 1), (250, 17), (15, 1)])
# Few programs over long contexts: where splitting the keys across programs pays.
LONG_DECODES = [Case("decode x1 at 8k", [(8191, 1)]), Case("decode x4 at 4k", [(4095, 1)] * 4)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
FORCED_SPLITS = 4
INTERPRETED_MAX_TOKENS = 64  # a prefill of 1,024 tokens takes the interpreter minutes


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float().cpu() - expected.float().cpu()).norm() / expected.float().cpu().norm()).item()


def paged_attention(inputs: LayerInputs, **options) -> torch.Tensor:
    from prefixcache.kernels.triton_ops.paged_attention import paged_attention

    meta = inputs.meta
    return paged_attention(inputs.query, inputs.key_cache, inputs.value_cache, meta.query_start_loc, meta.seq_lens,
                           meta.block_tables, meta.max_query_len, inputs.scale, max(meta.seq_lens_list), **options)


def check(case: Case, dtype: torch.dtype, device: str) -> list[str]:
    """Both kernels against the reference, through the Triton backend's per-layer calls."""
    inputs = make_inputs(case, dtype, device, seed=1)
    meta = inputs.meta
    expected_keys, expected_values = inputs.key_cache.cpu(), inputs.value_cache.cpu()
    reshape_and_cache_reference(
        inputs.key.cpu(), inputs.value.cpu(), expected_keys, expected_values, meta.slot_mapping.cpu()
    )
    backend = get_attention_backend("triton", device, dtype=dtype)
    backend.write_kv(inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, meta)
    cache_ok = torch.equal(inputs.key_cache.cpu(), expected_keys) and torch.equal(
        inputs.value_cache.cpu(), expected_values
    )
    output = backend.attend(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, meta, inputs.scale
    )
    expected = paged_attention_reference(
        inputs.query.cpu(), expected_keys, expected_values, meta.query_lens_list, meta.seq_lens_list,
        meta.block_tables.tolist(), inputs.scale,
    )
    error = relative_error(output, expected)
    split_error = relative_error(paged_attention(inputs, kv_splits=FORCED_SPLITS), expected)
    passed = cache_ok and max(error, split_error) < TOLERANCE[dtype]
    return [case.name, dtype_name(dtype), "exact" if cache_ok else "WRONG", f"{error:.1e}", f"{split_error:.1e}",
            "ok" if passed else "FAIL"]


def time_case(case: Case, dtype: torch.dtype) -> list[str]:
    from triton.testing import do_bench

    inputs: LayerInputs = make_inputs(case, dtype, "cuda")
    args = (inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, inputs.meta)
    triton_backend = get_attention_backend("triton", "cuda", dtype=dtype)
    torch_backend = get_attention_backend("torch", "cuda", dtype=dtype)
    write_ms = do_bench(
        lambda: triton_backend.write_kv(inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, inputs.meta),
        return_mode="median",
    )
    attend_ms = do_bench(lambda: triton_backend.attend(*args, inputs.scale), return_mode="median")
    unsplit_ms = do_bench(lambda: paged_attention(inputs, kv_splits=1), return_mode="median")
    torch_ms = do_bench(lambda: torch_backend.attend(*args, inputs.scale), return_mode="median")
    dense_ms = do_bench(dense_sdpa(case, dtype, "cuda"), return_mode="median")
    return [
        case.name, dtype_name(dtype), f"{write_ms:.4f}", f"{attend_ms:.4f}", f"{unsplit_ms:.4f}", f"{torch_ms:.4f}",
        f"{dense_ms:.4f}", f"{attend_ms / dense_ms:.2f}",
    ]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the checks under Triton's interpreter, float32, no timings")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (the first check does)
        dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # the interpreter computes bfloat16 dots wrongly
        print(f"device: CPU, Triton's interpreter, torch {torch.__version__}")
    elif not torch.cuda.is_available():
        print("kernels_cuda.py needs a CUDA GPU and found none; --device cpu runs its checks under Triton's "
              "interpreter, benchmarks/kernels_cpu.py times the CPU path", file=sys.stderr)
        return 1
    else:
        dtypes = (torch.float32, torch.bfloat16)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    cases = [*CASES, MIXED, *LONG_DECODES]
    if args.device == "cpu":
        cases = [case for case in cases if sum(new for _, new in case.sequences) <= INTERPRETED_MAX_TOKENS]
    checks = [check(case, dtype, args.device) for dtype in dtypes for case in cases]
    print("\nTriton kernels against the reference")
    print_table(["case", "dtype", "reshape_and_cache", "attention rel err", f"{FORCED_SPLITS} splits rel err",
                 "result"], checks)
    if args.device == "cuda":
        print("\nOne layer, SmolLM2 attention shape (9 q heads, 3 kv heads, head_dim 64, 16-token blocks); median ms")
        timings = [time_case(case, dtype) for dtype in dtypes for case in [*CASES, *LONG_DECODES]]
        print_table(["case", "dtype", "triton write", "triton attend", "unsplit", "torch paged", "dense SDPA",
                     "attend/SDPA"], timings)
    passed = sum(row[-1] == "ok" for row in checks)
    print(f"\n{passed} of {len(checks)} checks ok ({', '.join(dtype_name(dtype) for dtype in dtypes)})")
    return 0 if passed == len(checks) else 2


if __name__ == "__main__":
    raise SystemExit(main())
