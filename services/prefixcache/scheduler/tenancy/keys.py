"""API keys are stored as `sha256:<64 hex digits>` of the key's UTF-8 bytes, never as themselves.

A key is a random secret (32 bytes or more, e.g. `openssl rand -hex 32`), so one unsalted SHA-256
is enough: nobody can guess a preimage, and the stored hash cannot be presented as a key. Matching
compares the presented key's hash with every stored one in constant time, so response timing tells
nothing about how close a guess came.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable

PREFIX = "sha256:"
HASH_FORMAT = re.compile(r"sha256:[0-9a-f]{64}")


def hash_api_key(key: str) -> str:
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


def is_key_hash(value: object) -> bool:
    return isinstance(value, str) and HASH_FORMAT.fullmatch(value) is not None


def matches(key: str, stored_hashes: Iterable[str]) -> bool:
    """Whether `key` hashes to one of `stored_hashes`, comparing with every one of them."""
    presented = hash_api_key(key).encode()
    found = False
    for stored in stored_hashes:
        found |= hmac.compare_digest(presented, stored.encode())
    return found
