"""Secrets from the environment: a secret given as a command-line flag shows in every user's `ps`."""
from __future__ import annotations

import os
from pathlib import Path

from prefixcache.arg_types import decoded_utf8

CACHE_SALT_ENV = "PREFIXCACHE_CACHE_SALT"
API_KEY_ENV = "PREFIXCACHE_API_KEY"


def env_secret(variable: str) -> str | None:
    """The variable's text, or None if unset. Raises ValueError if it is set but empty (a secret that
    went missing must not silently mean "none") or is not UTF-8 text."""
    value = os.environ.get(variable)
    if value == "":
        raise ValueError(f"${variable} is set but empty; unset it for none")
    if value is None:
        return None
    try:
        return decoded_utf8(value)
    except ValueError:
        raise ValueError(f"${variable} is not valid UTF-8 text") from None


def cache_salt(given: str | None, tenant: str | None = None) -> str | None:
    """The salt given on the command line, else the environment's (unless a tenant was given).

    Raises ValueError if the variable is set but empty (a tenant whose salt went missing must not
    silently share every unsalted prefix) or is not UTF-8 text."""
    if given is not None or tenant is not None:
        return given
    return env_secret(CACHE_SALT_ENV)


def api_key(key_file: Path | None) -> str | None:
    """The API key in `key_file` (its first line), else `$PREFIXCACHE_API_KEY`, else None. Raises
    ValueError for an unreadable or empty file, or a variable set but empty."""
    if key_file is None:
        return env_secret(API_KEY_ENV)
    try:
        key = key_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {key_file}: cannot read it ({type(error).__name__})") from None
    if not key:
        raise ValueError(f"--api-key-file {key_file}: the file is empty")
    return key
