"""Fixtures of the scheduler tests: the embedded model's real tokenizer, loaded once per module."""
from __future__ import annotations

import pytest

from prefixcache.tokenizer.text import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    from prefixcache.model_store.store import ensure_default_model

    return TextTokenizer(ensure_default_model())
