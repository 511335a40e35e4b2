"""Fixtures shared by every test folder: the embedded model's directory (converted once) and a known prompt."""
from __future__ import annotations

from pathlib import Path

import pytest

# The chat-templated "What is the capital of France?" (default system prompt, generation prompt).
FRANCE_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from prefixcache.model_store.store import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def france_prompt() -> list[int]:
    return list(FRANCE_PROMPT)


@pytest.fixture(scope="session")
def chat_prompt(model_dir: Path):
    """Token ids of a one-turn chat, templated by transformers from our converted tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def template(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    return template
