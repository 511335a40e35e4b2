"""Worker fixtures: the embedded model and its transformers twin are loaded once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.services.common.model_store import ensure_default_model
from prefixcache.services.worker.model_runner import ModelRunner

# The chat-templated "What is the capital of France?" (default system prompt, generation prompt).
FRANCE_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm_runner(smollm_dir: Path) -> ModelRunner:
    return ModelRunner(smollm_dir, dtype="float32")


@pytest.fixture(scope="session")
def smollm_reference(smollm_dir: Path):
    from runner_harness import load_reference

    return load_reference(smollm_dir)


@pytest.fixture(scope="session")
def france_prompt() -> list[int]:
    return list(FRANCE_PROMPT)


@pytest.fixture(scope="session")
def chat_prompt(smollm_dir: Path):
    """Token ids of a one-turn chat, templated by transformers from our converted tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)

    def template(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    return template
