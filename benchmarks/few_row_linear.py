"""The few-row linear kernel on the embedded model's weights: float32 panels against 4-/8-bit blocks.

Run by hand: `.venv/bin/python benchmarks/few_row_linear.py [--repeats 7]`. Packs every projection of
SmolLM2-135M's 30 layers (fused as the worker fuses them) and its tied logits head both ways, checks
that the two give the same bits for each row count, then times one pass over all 30 layers'
projections, and one over the head, for each, alternating between the two (medians, ms). One pass
reads 425 MB of weights as float32 and 66 MB as blocks, so the weights are not in cache.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from attention_cases import print_table
from safetensors.torch import load_file

from prefixcache.kernels.cpu.native import native_cpu_kernels
from prefixcache.model_store.store import ensure_default_model

ROW_COUNTS = (1, 2, 4, 8, 16, 64, 128)


def layer_weights(checkpoint: dict[str, torch.Tensor], layers: int) -> list[torch.Tensor]:
    """Each layer's qkv, o, gate_up and down weights, fused as the worker fuses them."""
    weights = []
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        attention, mlp = prefix + "self_attn.", prefix + "mlp."
        weights.append(torch.cat([checkpoint[attention + f"{name}_proj.weight"] for name in "qkv"]))
        weights.append(checkpoint[attention + "o_proj.weight"])
        weights.append(torch.cat([checkpoint[mlp + "gate_proj.weight"], checkpoint[mlp + "up_proj.weight"]]))
        weights.append(checkpoint[mlp + "down_proj.weight"])
    return weights


def timed_ms(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    kernels = native_cpu_kernels()
    if kernels is None:
        print("the native CPU kernels do not run here (see the log)")
        return 1
    checkpoint = load_file(ensure_default_model() / "model.safetensors")
    groups = {"projections": layer_weights(checkpoint, layers=30), "head": [checkpoint["model.embed_tokens.weight"]]}
    forms = {"f32": kernels.pack_few_row_weight, "blocks": kernels.pack_few_row_blocks}
    packed = {(group, form): [pack(weight) for weight in weights]
              for group, weights in groups.items() for form, pack in forms.items()}
    if any(weight is None for group in groups for weight in packed[group, "blocks"]):
        print("some weights of the embedded model have no exact block form: nothing to compare")
        return 1
    for form in forms:
        print(f"packed bytes, {form}: {sum(p.nbytes for group in groups for p in packed[group, form]) / 1e6:.0f} MB")

    def one_pass(group: str, form: str, inputs: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """Every weight of `group` in `form`, each times its input."""
        return lambda: [kernels.few_row_linear(x, packs, weight.shape[0], None)
                        for x, packs, weight in zip(inputs, packed[group, form], groups[group], strict=True)]

    table = []
    generator = torch.Generator().manual_seed(0)
    for rows in ROW_COUNTS:
        line = [str(rows)]
        for group, weights in groups.items():
            inputs = [torch.randn(rows, weight.shape[1], generator=generator) for weight in weights]
            passes = {form: one_pass(group, form, inputs) for form in forms}
            assert all(map(torch.equal, passes["f32"](), passes["blocks"]())), f"{group}, {rows} rows: bits differ"
            times: dict[str, list[float]] = {form: [] for form in forms}
            for _ in range(args.repeats):  # the two forms alternate: this VM's speed drifts
                for form, run in passes.items():
                    times[form].append(timed_ms(run))
            f32, blocks = (statistics.median(times[form]) for form in forms)
            line += [f"{f32:.2f}", f"{blocks:.2f}", f"{f32 / blocks:.2f}x"]
        table.append(line)
    print(f"few-row linear, all 30 layers' projections and the logits head, {torch.get_num_threads()} threads "
          "(medians, ms; same bits both ways, checked)")
    print_table(["rows", "projections f32", "blocks", "speed-up", "head f32", "blocks", "speed-up"], table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
