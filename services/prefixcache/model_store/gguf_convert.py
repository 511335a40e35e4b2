"""Convert a Llama-architecture GGUF file into a standard Hugging Face model directory.

The output holds `config.json`, `model.safetensors` (float32, dequantized by the `gguf` package),
`tokenizer.json` and `tokenizer_config.json` (with the chat template), so every other part of the
system reads one format only.

Two GGUF conventions are undone here:
- Q and K projection rows are stored permuted for GGUF's interleaved RoPE layout (pairs of adjacent
  dimensions); Hugging Face Llama rotates the two halves of each head instead, so the rows are put back.
- The tokenizer is stored as a vocabulary plus merges with a named pre-tokenizer ("smollm"). We rebuild
  it with the original SmolLM2 pre-tokenization: every digit is its own pre-token (as llama.cpp and
  the original Hugging Face SmolLM2 tokenizer do), then GPT-2 byte-level splitting. So "2024" becomes
  four tokens and "a\\n\\n3" becomes ["a", "\\n\\n", "3"].

Needs numpy, gguf, safetensors and tokenizers, imported here and nowhere on the import path of the
services that only read converted directories.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

_CONTROL_TOKEN = 3  # gguf.TokenType.CONTROL

# GGUF tensor name (after the "blk.N." prefix) → Hugging Face Llama name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face directory for the Llama-architecture model in `gguf_path`."""
    reader = gguf.GGUFReader(str(gguf_path))
    fields = _read_fields(reader)
    architecture = fields.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: general.architecture is {architecture!r}; only 'llama' converts")
    config = _hf_config(fields)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(reader, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _tokenizer(fields).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(fields), indent=2) + "\n")


def _read_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _float32_value(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Keep the digits float32 actually has."""
    return float(f"{value:.7g}")


def _hf_config(fields: dict[str, Any]) -> dict[str, Any]:
    hidden = int(fields["llama.embedding_length"])
    num_heads = int(fields["llama.attention.head_count"])
    head_dim = int(fields.get("llama.rope.dimension_count", hidden // num_heads))
    rope_theta = _float32_value(fields.get("llama.rope.freq_base", 10000.0))
    tokens = fields["tokenizer.ggml.tokens"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(fields["llama.feed_forward_length"]),
        "num_hidden_layers": int(fields["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(fields.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(fields["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(fields["llama.context_length"]),
        "vocab_size": int(fields.get("llama.vocab_size", len(tokens))),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(fields["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(fields["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(fields.get("tokenizer.ggml.padding_token_id", fields["tokenizer.ggml.eos_token_id"])),
        "dtype": "float32",
    }


def _hf_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name, local = _hf_name(tensor.name)
        weights = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if local in heads:
            weights = _undo_rope_permutation(weights, heads[local])
        tensors[name] = weights
    return tensors


def _hf_name(gguf_name: str) -> tuple[str, str]:
    """(Hugging Face name, GGUF name without the layer prefix)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], gguf_name
    prefix, layer, local = gguf_name.split(".", 2)
    if prefix != "blk" or local not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_TENSORS[local]}", local


def _undo_rope_permutation(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Per head, GGUF orders rows (d0, d_half, d1, d_half+1, ...); Hugging Face wants (d0, d1, ..., d_half, ...)."""
    rows, cols = weights.shape
    half = rows // num_heads // 2
    return weights.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tokenizer(fields: dict[str, Any]) -> Tokenizer:
    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {fields.get('tokenizer.ggml.model')!r}; only 'gpt2' (BPE) converts")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    token_types = fields["tokenizer.ggml.token_type"]
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == _CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    return tokenizer


def _tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    tokens = fields["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(fields["llama.context_length"]),
        "chat_template": fields["tokenizer.chat_template"],
    }
