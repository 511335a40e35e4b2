"""Worker fixtures: the embedded model and its transformers twin are loaded once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.worker.model_runner import ModelRunner


@pytest.fixture(scope="session")
def smollm_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, dtype="float32")


@pytest.fixture(scope="session")
def smollm_reference(model_dir: Path):
    from runner_harness import load_reference

    return load_reference(model_dir)
