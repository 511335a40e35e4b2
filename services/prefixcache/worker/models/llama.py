"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Tokens of all sequences in a step are packed into one `[num_tokens, hidden]` batch: there is no
padding and no batch dimension. Each layer writes its new keys and values into the cache slots the
attention metadata names, then attends over the cache, so a prefix computed by an earlier request
is read exactly as if this request had computed it.

The QKV and gate/up projections are fused (one matmul each); `load_weight` splits a Hugging Face
checkpoint's separate tensors into them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.kernels.cpu.linear import CpuLinear, choose_layout, swap_in_cpu_linears
from prefixcache.kernels.cpu.native import NativeCpuKernels, native_cpu_kernels
from prefixcache.worker.kv_memory import free_device_memory
from prefixcache.worker.model_config import ModelConfig
from prefixcache.worker.models.rotary import RotaryEmbedding, rotate

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [num_blocks, block_size, Hkv, D]
Rotation = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of this step's positions, each [T, 1, D]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.native: NativeCpuKernels | None = None  # set by `lay_out_for_cpu` where the kernels run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.is_contiguous():
            return self.native.rms_norm(x, self.weight, self.eps)
        # Normalised in float32 and scaled in the model dtype, as transformers does. Written out
        # rather than `F.rms_norm`, whose CPU composite takes more ops and allocations for the same bits.
        wide = x.float()
        normalized = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True).add_(self.eps))
        return normalized.to(x.dtype).mul_(self.weight)

    def add_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual += x`, then the norm of the sum. The native kernel does both in one pass and
        writes the norm over `x` (a sublayer's fresh output, which nothing else reads)."""
        if self.native is not None and x.is_contiguous() and residual.is_contiguous():
            return self.native.add_rms_norm_(x, residual, self.weight, self.eps)
        return self(residual.add_(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.output_bias)
        self.native: NativeCpuKernels | None = None  # set by `lay_out_for_cpu` where the kernels run

    def forward(self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, metadata: Any,
                backend: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Queries and keys sit side by side in the fused output: rotate them in one go.
        query_key = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                               self.head_dim)
        if self.native is not None:  # in place in the projection's output, which nothing else reads
            query_key = self.native.rotate_(query_key, *rotation)
        else:
            query_key = rotate(query_key, rotation)
        query, key = query_key.split([self.num_heads, self.num_kv_heads], dim=1)
        value = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        backend.write_kv(key, value, key_cache, value_cache, metadata)
        attended = backend.attend(query, key, value, key_cache, value_cache, metadata, self.scale)
        return self.o_proj(attended.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.native: NativeCpuKernels | None = None  # set by `lay_out_for_cpu` where the kernels run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native is not None and gate_up.is_contiguous():
            return self.down_proj(self.native.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place in the projection's output, which nothing else reads.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation, kv_cache: KVCache,
                metadata: Any, backend: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous MLP's output, the running residual) → this layer's. The first layer gets the
        embeddings and no residual; the running residual is then the embeddings themselves.

        Each residual add happens where the next norm reads it (`RMSNorm.add_residual`)."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed = self.input_layernorm.add_residual(x, residual)
        attended = self.self_attn(normed, rotation, kv_cache, metadata, backend)
        return self.mlp(self.post_attention_layernorm.add_residual(attended, residual)), residual


# Hugging Face projection name → (our fused parameter's module, index of its slice)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], metadata: Any,
                backend: Any) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden], after writing the KV of all T tokens."""
        x = self.embed_tokens(input_ids)
        rotation = self.rotary.for_positions(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rotation, kv_cache, metadata, backend)
        return self.norm.add_residual(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → [N, vocab] float32 logits."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def untie_head_if_it_differs(self, head: torch.Tensor) -> None:
        """A config that ties the head to the embeddings, in a checkpoint that carries its own head:
        transformers uses the checkpoint's head, so we do too unless it equals the embeddings."""
        embeddings = self.embed_tokens.weight
        if head.shape != embeddings.shape:
            raise ValueError(f"checkpoint tensor lm_head.weight has shape {tuple(head.shape)}, "
                             f"the model expects {tuple(embeddings.shape)}")
        head = head.to(embeddings.device, embeddings.dtype)  # safetensors reads onto the CPU
        if not torch.equal(head, embeddings):
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False,
                                     device=embeddings.device, dtype=embeddings.dtype)
            self.lm_head.weight.copy_(head)

    def lay_out_for_cpu(self) -> None:
        """Swap every projection, the logits head included, for a `CpuLinear` (once, after loading),
        and let the norms, rotations and SwiGLU use the native CPU kernels where they run (float32).

        A tied head gets its own copy of the embeddings: the lookup needs them row by row.
        """
        projections = [m for m in self.modules() if isinstance(m, nn.Linear)]
        head = self.embed_tokens.weight if self.lm_head is None else None
        projection_bytes = sum(m.weight.nbytes for m in projections) + (head.nbytes if head is not None else 0)
        native = native_cpu_kernels() if self.embed_tokens.weight.dtype == torch.float32 else None
        try:
            free_memory: int | None = free_device_memory(torch.device("cpu"))
        except (OSError, RuntimeError):  # no /proc/meminfo: do not guess
            free_memory = None
        layout = choose_layout(self.embed_tokens.weight.dtype, projection_bytes, free_memory, native)
        swap_in_cpu_linears(self, layout)
        if head is not None:
            self.lm_head = CpuLinear(head, None, layout)
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, GatedMLP)):
                module.native = native

    def expected_checkpoint_names(self) -> set[str]:
        """Every Hugging Face tensor name a complete checkpoint must provide."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                     "mlp.down_proj.weight"]
        per_layer += [f"{hf}.weight" for hf in _FUSED]
        if self.config.qkv_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if self.config.output_bias:
            per_layer.append("self_attn.o_proj.bias")
        if self.config.mlp_bias:
            per_layer += ["mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"]
        for index in range(self.config.num_layers):
            names.update(f"model.layers.{index}.{name}" for name in per_layer)
        return names

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into its (possibly fused) parameter; skip those the model derives."""
        if name.endswith("rotary_emb.inv_freq"):
            return  # recomputed
        local = name.removeprefix("model.")
        target, index = local, None
        for hf_prefix, (fused, slice_index) in _FUSED.items():
            layer, _, rest = local.partition(f".{hf_prefix}.")
            if rest:
                target, index = f"{layer}.{fused}.{rest}", slice_index
                break
        try:
            parameter = self.get_parameter(target)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name} has no place in a {self.config.architecture}") from None
        if index is not None:
            parameter = self._fused_slice(target, parameter, index)
        if parameter.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(parameter.shape)}")
        parameter.copy_(tensor)

    def _fused_slice(self, target: str, parameter: torch.Tensor, index: int) -> torch.Tensor:
        if ".qkv_proj." in target:
            q_size = self.config.num_heads * self.config.head_dim
            kv_size = self.config.num_kv_heads * self.config.head_dim
            sizes = [q_size, kv_size, kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return parameter.split(sizes, dim=0)[index]
