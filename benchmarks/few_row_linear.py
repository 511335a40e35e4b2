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
from safetensors.torch import load_file

from prefixcache.kernels.native_cpu import native_cpu_kernels
from prefixcache.services.common.model_store import ensure_default_model

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
    projections = layer_weights(checkpoint, layers=30)
    head = checkpoint["model.embed_tokens.weight"]
    panels = [kernels.pack_few_row_weight(weight) for weight in projections]
    blocks = [kernels.pack_few_row_blocks(weight) for weight in projections]
    head_panels, head_blocks = kernels.pack_few_row_weight(head), kernels.pack_few_row_blocks(head)
    if any(packed is None for packed in [*blocks, head_blocks]):
        print("some weights of the embedded model have no exact block form: nothing to compare")
        return 1
    print(f"packed bytes: float32 panels {sum(p.nbytes for p in [*panels, head_panels]) / 1e6:.0f} MB, "
          f"blocks {sum(p.nbytes for p in [*blocks, head_blocks]) / 1e6:.0f} MB")

    def projections_pass(packs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for x, packed, weight in zip(inputs, packs, projections, strict=True):
                kernels.few_row_linear(x, packed, weight.shape[0], None)
        return run

    rows_out = []
    generator = torch.Generator().manual_seed(0)
    for rows in ROW_COUNTS:
        inputs = [torch.randn(rows, weight.shape[1], generator=generator) for weight in projections]
        head_input = torch.randn(rows, head.shape[1], generator=generator)
        for x, weight, panel, block in zip(inputs, projections, panels, blocks, strict=True):
            assert torch.equal(kernels.few_row_linear(x, panel, weight.shape[0], None),
                               kernels.few_row_linear(x, block, weight.shape[0], None))
        assert torch.equal(kernels.few_row_linear(head_input, head_panels, head.shape[0], None),
                           kernels.few_row_linear(head_input, head_blocks, head.shape[0], None))
        times: dict[str, list[float]] = {"panels": [], "blocks": [], "head panels": [], "head blocks": []}
        for _ in range(args.repeats):
            times["panels"].append(timed_ms(projections_pass(panels, inputs)))
            times["blocks"].append(timed_ms(projections_pass(blocks, inputs)))
            times["head panels"].append(timed_ms(lambda: kernels.few_row_linear(head_input, head_panels, head.shape[0],
                                                                                None)))
            times["head blocks"].append(timed_ms(lambda: kernels.few_row_linear(head_input, head_blocks, head.shape[0],
                                                                                None)))
        median = {name: statistics.median(values) for name, values in times.items()}
        rows_out.append([str(rows), f"{median['panels']:.2f}", f"{median['blocks']:.2f}",
                         f"{median['panels'] / median['blocks']:.2f}x", f"{median['head panels']:.2f}",
                         f"{median['head blocks']:.2f}", f"{median['head panels'] / median['head blocks']:.2f}x"])
    header = ["rows", "projections f32", "blocks", "speed-up", "head f32", "head blocks", "speed-up"]
    widths = [max(len(row[i]) for row in [header, *rows_out]) for i in range(len(header))]
    print(f"few-row linear, all 30 layers' projections and the logits head, {torch.get_num_threads()} threads "
          "(medians, ms; same bits both ways, checked)")
    for row in [header, *rows_out]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
