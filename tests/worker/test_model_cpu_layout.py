"""The loaded embedded model runs every projection, the tied head included, from CPU weight layouts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.kernels.cpu.linear import CpuLinear
from prefixcache.kernels.cpu.native import native_cpu_kernels


def test_loaded_cpu_model_serves_every_projection_from_cpu_layouts(smollm_runner) -> None:
    model = smollm_runner.model
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model.lm_head, CpuLinear)  # SmolLM2 ties its head: it gets its own copy
    if native_cpu_kernels() is not None:  # the GGUF's Q4_1 projections and Q8_0 head stream as blocks
        linears = [module for module in model.modules() if isinstance(module, CpuLinear)]
        assert len(linears) == 4 * model.config.num_layers + 1
        assert all(linear.weight_packed.dtype == torch.uint8 for linear in linears)
        assert model.lm_head.weight_packed.shape[2] == 1088 and linears[0].weight_packed.shape[2] == 640
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens.weight),
                               rtol=1e-4, atol=1e-4)
