"""A cache salt from the environment: a secret given as a command-line flag shows in every user's `ps`."""
from __future__ import annotations

import os

CACHE_SALT_ENV = "PREFIXCACHE_CACHE_SALT"


def cache_salt(given: str | None, tenant: str | None = None) -> str | None:
    """The salt given on the command line, else the environment's (unless a tenant was given)."""
    if given is not None or tenant is not None:
        return given
    return os.environ.get(CACHE_SALT_ENV) or None
