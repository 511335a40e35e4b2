"""A cache salt from the environment: a secret given as a command-line flag shows in every user's `ps`."""
from __future__ import annotations

import os

from prefixcache.arg_types import decoded_utf8

CACHE_SALT_ENV = "PREFIXCACHE_CACHE_SALT"


def cache_salt(given: str | None, tenant: str | None = None) -> str | None:
    """The salt given on the command line, else the environment's (unless a tenant was given).

    Raises ValueError if the variable is set but empty (a tenant whose salt went missing must not
    silently share every unsalted prefix) or is not UTF-8 text."""
    if given is not None or tenant is not None:
        return given
    salt = os.environ.get(CACHE_SALT_ENV)
    if salt == "":
        raise ValueError(f"${CACHE_SALT_ENV} is set but empty; unset it for no salt")
    if salt is None:
        return None
    try:
        return decoded_utf8(salt)
    except ValueError:
        raise ValueError(f"${CACHE_SALT_ENV} is not valid UTF-8 text") from None
