"""Per-layer cost of the torch attention path on CPU, at SmolLM2's attention shape.

Run by hand: `.venv/bin/python benchmarks/kernels_cpu.py`. For each case it checks the torch backend
against the reference, then times one layer's `write_kv` + `attend` (the per-step plan is built once
and reused by all layers, so it is timed apart), the same without the native kernels
(`kernels/prefixcache/kernels/cpu/native.py`: gathers and torch's flash kernel instead), and SDPA over dense, unpaged
tensors of the same size.
"""

from __future__ import annotations

import argparse

import torch
from attention_cases import CASES, dense_sdpa, make_inputs, median_ms, print_table

from prefixcache.kernels import TorchAttentionBackend, get_attention_backend, paged_attention_reference
from prefixcache.kernels.cpu.attention_plan import TorchAttentionPlan
from prefixcache.kernels.cpu.native import native_cpu_kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = get_attention_backend("torch", "cpu")
    without_native = TorchAttentionBackend()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for case in CASES:
            inputs = make_inputs(case, dtype, "cpu")
            meta = inputs.meta
            layer_args = (inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, meta)

            def layer(backend=backend) -> torch.Tensor:
                meta.backend_cache.clear()  # each backend plans the step its own way
                backend.write_kv(inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, meta)
                return backend.attend(*layer_args, inputs.scale)

            output = layer()
            expected = paged_attention_reference(
                inputs.query, inputs.key_cache, inputs.value_cache, meta.query_lens_list, meta.seq_lens_list,
                meta.block_tables.tolist(), inputs.scale,
            )
            error = ((output.float() - expected.float()).norm() / expected.float().norm()).item()
            plan_ms = median_ms(lambda: TorchAttentionPlan.build(meta, inputs.key_cache.shape[1]))
            layer_ms = median_ms(layer)
            torch_only_ms = median_ms(lambda: layer(without_native))
            dense_ms = median_ms(dense_sdpa(case, dtype, "cpu"))
            rows.append([
                case.name, str(dtype).removeprefix("torch."), f"{layer_ms:.3f}", f"{torch_only_ms:.3f}",
                f"{torch_only_ms / layer_ms:.2f}", f"{dense_ms:.3f}", f"{plan_ms:.3f}", f"{error:.1e}",
            ])
    native = "with" if native_cpu_kernels() else "without (not available here)"
    print(f"torch attention path {native} the native kernels, one layer, {torch.get_num_threads()} threads "
          "(medians, ms; speed-up = torch only / serving path)")
    print_table(["case", "dtype", "write+attend", "torch only", "speed-up", "dense SDPA", "plan/step", "rel err"],
                rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
