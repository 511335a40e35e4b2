"""Fixtures for the service tests: the embedded model's directory (converted once, shared)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from prefixcache.services.common.model_store import ensure_default_model

    return ensure_default_model()
