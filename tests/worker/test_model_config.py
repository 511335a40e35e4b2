"""Reading config.json: the switches that tell Llama-family checkpoints apart, and what we refuse."""
from __future__ import annotations

import json

import pytest

from prefixcache.worker.model_config import ModelConfig

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32768, "eos_token_id": 2}


def config(architecture: str, **changes: object) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "architectures": [architecture], **changes})


def test_mistral_sliding_window_caps_the_context() -> None:
    assert config("MistralForCausalLM", sliding_window=2048).max_model_len == 2048
    assert config("MistralForCausalLM", sliding_window=None).max_model_len == 32768
    assert config("MistralForCausalLM").max_model_len == 4096  # transformers' default window when the key is absent


def test_qwen2_has_qkv_bias_and_ignores_an_unused_window() -> None:
    qwen = config("Qwen2ForCausalLM", sliding_window=4096, use_sliding_window=False)
    assert (qwen.qkv_bias, qwen.output_bias, qwen.max_model_len) == (True, False, 32768)
    # As in transformers, a Qwen2 config that does not say uses no window; one that says so does.
    assert config("Qwen2ForCausalLM", sliding_window=4096).max_model_len == 32768
    assert config("Qwen2ForCausalLM", sliding_window=2048, use_sliding_window=True, max_window_layers=1).max_model_len == 2048


@pytest.mark.parametrize("changes, max_model_len", [
    ({"max_window_layers": 1}, 4096),  # layer 1 of 2 slides, within transformers' default window
    ({"max_window_layers": 2, "sliding_window": 100}, 32768),  # no layer from 2 on: none slides
    ({}, 32768),  # the default max_window_layers, 28, is beyond both layers
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 100}, 100),
    ({"layer_types": ["full_attention", "full_attention"], "sliding_window": 100}, 32768),
])
def test_qwen2_slides_only_in_the_layers_transformers_slides(changes: dict, max_model_len: int) -> None:
    assert config("Qwen2ForCausalLM", use_sliding_window=True, **changes).max_model_len == max_model_len


def test_llama_has_no_sliding_window() -> None:
    assert config("LlamaForCausalLM", sliding_window=100).max_model_len == 32768


def test_a_config_without_architectures_is_read_by_its_model_type() -> None:
    raw = {**BASE, "model_type": "qwen2"}
    assert ModelConfig.from_dict(raw).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_dict({**BASE, "model_type": "gpt2"})


def test_llama_attention_bias_covers_the_output_projection() -> None:
    llama = config("LlamaForCausalLM", attention_bias=True)
    assert (llama.qkv_bias, llama.output_bias) == (True, True)


def test_rope_from_old_and_new_style_configs() -> None:
    old = config("LlamaForCausalLM", rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    new = config("LlamaForCausalLM", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192})
    assert old.rope == new.rope and old.rope.theta == 500000.0 and old.rope.kind == "llama3"
    top_level = config("LlamaForCausalLM", original_max_position_embeddings=8192,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    assert top_level.rope == new.rope  # the pre-scaling length kept at the top level


def test_generation_config_adds_its_end_of_turn_tokens(tmp_path) -> None:
    # Qwen2-Instruct's config.json names <|endoftext|>; only generation_config.json names <|im_end|>.
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["Qwen2ForCausalLM"]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        ModelConfig.from_model_dir(tmp_path)


def test_derived_defaults() -> None:
    llama = config("LlamaForCausalLM", num_key_value_heads=None, eos_token_id=[2, 7])
    assert (llama.num_kv_heads, llama.head_dim, llama.eos_token_ids) == (4, 16, (2, 7))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, "unsupported architecture"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs 'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be positive"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}, "high_freq_factor > low_freq_factor"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantized checkpoints \(gptq\)"),
    ],
)
def test_unservable_configs_say_what_is_wrong(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"], **changes})
