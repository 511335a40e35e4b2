"""Prompts for the e2e tests, as token ids of real English text (argmax ties are rarer than on noise)."""
from __future__ import annotations

from functools import cache

from prefixcache.tokenizer.text import TextTokenizer

TOPICS = ("rivers", "bridges", "orchards", "lighthouses", "glaciers", "libraries", "harbors", "deserts")


@cache
def tokenizer() -> TextTokenizer:
    from prefixcache.model_store.store import ensure_default_model

    return TextTokenizer(ensure_default_model())


def shared_prefix(num_tokens: int, theme: str) -> list[int]:
    """Exactly `num_tokens` tokens of a numbered list of notes about `theme`."""
    lines = []
    ids: list[int] = []
    number = 0
    while len(ids) < num_tokens:
        number += 1
        topic = TOPICS[number % len(TOPICS)]
        lines.append(f"Note {number} on {theme}: the {topic} of the region were surveyed in year {1900 + 7 * number}.")
        ids = tokenizer().encode("\n".join(lines))
    return ids[:num_tokens]


def question(text: str) -> list[int]:
    return tokenizer().encode("\nQuestion: " + text + "\nAnswer:")
