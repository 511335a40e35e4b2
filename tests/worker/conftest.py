"""Worker fixtures: the embedded model and its transformers twin are loaded once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.worker.model_runner import ModelRunner

ORACLE_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea in 2024.",
                    "List three prime numbers and explain why each one is prime.")


@pytest.fixture(scope="session")
def smollm_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, dtype="float32")


@pytest.fixture(scope="session")
def smollm_reference(model_dir: Path):
    from runner_harness import load_reference

    return load_reference(model_dir)


@pytest.fixture(scope="session")
def oracle_prompts(chat_prompt) -> list[list[int]]:
    """The chat-templated oracle questions the embedded model's tests generate from."""
    return [chat_prompt(question) for question in ORACLE_QUESTIONS]
