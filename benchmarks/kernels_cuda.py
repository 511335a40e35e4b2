"""The Triton kernels on a CUDA GPU: checked against the plain-torch reference, then timed against torch SDPA.

Run by hand on a machine with a GPU: `python benchmarks/kernels_cuda.py`. Exits 1 without CUDA, and 2
when a check fails. Timing columns, per layer (medians, ms, `triton.testing.do_bench`):
- `triton write`: `reshape_and_cache` of the step's new keys and values;
- `triton attend`: the paged attention kernel;
- `torch paged`: the torch backend (gather over the block table + SDPA) on the same GPU;
- `dense SDPA`: SDPA over contiguous, unpaged tensors of the same sizes, the bar to reach.
"""

from __future__ import annotations

import sys

import torch
from attention_cases import CASES, Case, LayerInputs, dense_sdpa, make_inputs, print_table

from prefixcache.kernels import get_attention_backend, paged_attention_reference, reshape_and_cache_reference

MIXED = Case("mixed batch", [(0, 300), (700, 324), (1023, 1), (511, 1), (64, 1), (250, 17), (15, 1)])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float().cpu() - expected.float().cpu()).norm() / expected.float().cpu().norm()).item()


def check(case: Case, dtype: torch.dtype, device: str = "cuda") -> list[str]:
    """Both kernels against the reference, through the Triton backend's per-layer calls."""
    inputs = make_inputs(case, dtype, device, seed=1)
    meta = inputs.meta
    expected_keys, expected_values = inputs.key_cache.cpu(), inputs.value_cache.cpu()
    reshape_and_cache_reference(
        inputs.key.cpu(), inputs.value.cpu(), expected_keys, expected_values, meta.slot_mapping.cpu()
    )
    backend = get_attention_backend("triton", device)
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
    passed = cache_ok and error < TOLERANCE[dtype]
    return [case.name, dtype_name(dtype), "exact" if cache_ok else "WRONG", f"{error:.1e}", "ok" if passed else "FAIL"]


def time_case(case: Case, dtype: torch.dtype) -> list[str]:
    from triton.testing import do_bench

    inputs: LayerInputs = make_inputs(case, dtype, "cuda")
    args = (inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, inputs.meta)
    triton_backend = get_attention_backend("triton", "cuda")
    torch_backend = get_attention_backend("torch", "cuda")
    write_ms = do_bench(
        lambda: triton_backend.write_kv(inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, inputs.meta),
        return_mode="median",
    )
    attend_ms = do_bench(lambda: triton_backend.attend(*args, inputs.scale), return_mode="median")
    torch_ms = do_bench(lambda: torch_backend.attend(*args, inputs.scale), return_mode="median")
    dense_ms = do_bench(dense_sdpa(case, dtype, "cuda"), return_mode="median")
    return [
        case.name, dtype_name(dtype), f"{write_ms:.4f}", f"{attend_ms:.4f}", f"{torch_ms:.4f}", f"{dense_ms:.4f}",
        f"{attend_ms / dense_ms:.2f}",
    ]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels_cuda.py needs a CUDA GPU and found none; on CPU, run benchmarks/kernels_cpu.py", file=sys.stderr)
        return 1
    dtypes = (torch.float32, torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    checks = [check(case, dtype) for dtype in dtypes for case in [*CASES, MIXED]]
    print("\nTriton kernels against the reference")
    print_table(["case", "dtype", "reshape_and_cache", "attention rel err", "result"], checks)
    print("\nOne layer, SmolLM2 attention shape (9 q heads, 3 kv heads, head_dim 64, 16-token blocks); median ms")
    timings = [time_case(case, dtype) for dtype in dtypes for case in CASES]
    print_table(
        ["case", "dtype", "triton write", "triton attend", "torch paged", "dense SDPA", "attend/SDPA"], timings
    )
    return 0 if all(row[-1] == "ok" for row in checks) else 2


if __name__ == "__main__":
    raise SystemExit(main())
