"""Tenants files for tests: fresh random API keys, and the file that lists their hashes."""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from prefixcache.scheduler.tenancy import hash_api_key

SALT_KEY = "test-salt-key-" + "0" * 32


def new_key() -> str:
    return secrets.token_hex(32)


def tenants_document(keys: dict[str, str], admins: dict[str, str] | None = None, **extra: object) -> dict:
    """A tenants file's content: one tenant per name in `keys` (name -> API key), admins likewise.
    `extra` adds top-level fields (limits) or, as `<name>=dict`, fields of one tenant."""
    tenants = [{"name": name, "api_keys": [hash_api_key(key)], **extra.pop(name, {})} for name, key in keys.items()]
    return {"salt_key": SALT_KEY, "tenants": tenants,
            "admins": [{"name": name, "api_keys": [hash_api_key(key)]} for name, key in (admins or {}).items()],
            **extra}


def write_tenants(path: Path, document: dict) -> Path:
    """Replace the file the way a Kubernetes Secret update does: a new file moved over the old."""
    staged = path.with_suffix(".staged")
    staged.write_text(json.dumps(document))
    os.replace(staged, path)
    return path
