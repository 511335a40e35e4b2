"""What the worker needs from a Hugging Face `config.json`, validated up front.

Every Llama-family checkpoint we serve (Llama 2/3, Mistral, Qwen2, SmolLM) is the same decoder:
RMSNorm, rotary attention with grouped KV heads, a SiLU-gated MLP. They differ in a few switches
read here: biases on the QKV projection (Qwen2), tied embeddings, RoPE theta and scaling, and a
sliding window (served by capping the context at the window, where it changes nothing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Each supported architecture by the `model_type` that names it in configs without `architectures`.
_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURE_OF_MODEL_TYPE.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    scaling: dict[str, float] = field(default_factory=dict)  # the extra parameters of `kind`


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    output_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory: config.json is missing")
        config = cls.from_dict(read_json_file(path), source=str(path))
        # Chat checkpoints often end a turn with a token that only generation_config.json names
        # (Qwen2-Instruct's <|im_end|>, Llama-3-Instruct's <|eot_id|>): stop on those too.
        generation_path = Path(model_dir) / "generation_config.json"
        if generation_path.is_file():
            generation = read_json_file(generation_path)
            extra = _token_ids(generation.get("eos_token_id") if isinstance(generation, dict) else None)
            config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architecture = _architecture(raw, source)
        if quantization := raw.get("quantization_config"):
            method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
            raise ValueError(f"{source}: quantized checkpoints ({method}) are not supported; "
                             "use float32, float16 or bfloat16 weights")
        hidden_size = _positive_int(raw, "hidden_size", source)
        num_heads = _positive_int(raw, "num_attention_heads", source)
        # Absent or null means what transformers makes of it: no GQA, hidden_size / heads.
        num_kv_heads = _optional_positive_int(raw, "num_key_value_heads", num_heads, source)
        head_dim = _optional_positive_int(raw, "head_dim", hidden_size // num_heads, source)
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")
        activation = raw.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"{source}: hidden_act={activation!r} is not supported (only 'silu')")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_positive_int(raw, "intermediate_size", source),
            num_layers=_positive_int(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_positive_int(raw, "vocab_size", source),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw, source),
            max_model_len=_max_model_len(raw, architecture, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,  # Qwen2 always has QKV biases, never an output bias
            output_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
        )


def _architecture(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if not architectures and raw.get("model_type") in _ARCHITECTURE_OF_MODEL_TYPE:  # an older or hand-written config
        return _ARCHITECTURE_OF_MODEL_TYPE[raw["model_type"]]
    raise ValueError(f"{source}: unsupported architecture {architectures or raw.get('model_type')!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _positive_int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _optional_positive_int(raw: dict[str, Any], key: str, default: int, source: str) -> int:
    """`default` when the key is absent or null; otherwise it must be a positive integer."""
    return default if raw.get(key) is None else _positive_int(raw, key, source)


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`.
    parameters = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(parameters.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = parameters.pop("rope_type", parameters.pop("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "linear" and "factor" not in parameters:
        raise ValueError(f"{source}: linear rope scaling needs 'factor'")
    if kind == "llama3":
        # Some configs keep the pre-scaling length beside the scaling parameters, at the top level.
        if "original_max_position_embeddings" not in parameters and "original_max_position_embeddings" in raw:
            parameters["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        required = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in required if key not in parameters]
        if missing:
            raise ValueError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    numeric = {key: float(value) for key, value in parameters.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    _check_rope_scaling(kind, numeric, source)
    return RopeConfig(theta=theta, kind=kind, scaling=numeric)


def _check_rope_scaling(kind: str, scaling: dict[str, float], source: str) -> None:
    """Values the scaling formulas would divide by or turn upside down."""
    if kind in ("linear", "llama3") and not scaling.get("factor", 0) > 0:
        raise ValueError(f"{source}: rope scaling factor must be positive, got {scaling.get('factor')}")
    if kind == "llama3":
        if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ValueError(f"{source}: llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                             f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")
        if not scaling["original_max_position_embeddings"] > 0:
            raise ValueError(f"{source}: llama3 rope scaling needs a positive original_max_position_embeddings")


def _max_model_len(raw: dict[str, Any], architecture: str, source: str) -> int:
    length = _positive_int(raw, "max_position_embeddings", source)
    window = _sliding_window(raw, architecture)
    if window:
        # Attention over at most `window` tokens equals full attention while the context fits in it.
        length = min(length, int(window))
    return length


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    """The window some layer attends within, read as transformers reads it (its defaults for absent
    keys included); None when every layer attends to the whole context."""
    if architecture == "MistralForCausalLM":
        return raw.get("sliding_window", 4096)
    if architecture != "Qwen2ForCausalLM" or not raw.get("use_sliding_window", False):
        return None  # Llama has no window; Qwen2 declares one it uses only when told to
    layer_types = raw.get("layer_types")
    if layer_types is None:  # the layers from `max_window_layers` on slide
        slides = raw.get("max_window_layers", 28) < raw["num_hidden_layers"]
    else:
        slides = "sliding_attention" in layer_types
    return raw.get("sliding_window", 4096) if slides else None


def read_json_file(path: Path) -> Any:
    """A checkpoint's JSON file; a ValueError that names the file if it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(token) for token in value)
