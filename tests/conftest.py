"""Fixtures shared by every test folder: the embedded model's directory (converted once), a known prompt,
and `device`, which runs a test once on every device this machine has."""
from __future__ import annotations

from pathlib import Path

import pytest

# The chat-templated "What is the capital of France?" (default system prompt, generation prompt).
FRANCE_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes `device` runs on the CPU always and on CUDA when this machine has it (that run is
    marked `cuda`, so `pytest -m cuda` selects it). Compare like with like: move a reference to `device`."""
    if "device" in metafunc.fixturenames:
        import torch  # here, not at the top: the tokenizer's and the scheduler's tests need no torch

        devices = [pytest.param(torch.device("cpu"), id="cpu")]
        if torch.cuda.is_available():
            devices.append(pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.cuda))
        metafunc.parametrize("device", devices)


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
