"""Server-side tenant salts: salt = hex(HMAC-SHA256(key, tenant)), so a client cannot pick another
tenant's salt, and one-way labels for traces from the same key.

The key comes from the tenants file's `salt_key`, else `PREFIXCACHE_TENANT_SALT_KEY` (give every
scheduler replica the same one, so a tenant's hashes agree across replicas); without either, each
process draws a random key, which isolates tenants just as well but only within one process.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

KEY_ENV = "PREFIXCACHE_TENANT_SALT_KEY"
# A label is an HMAC under the same key with this prefix: a tenant name never holds a control
# character (`config.py`), so no tenant's salt message can equal another's label message.
_LABEL_PREFIX = b"label\x00"
LABEL_HEX_CHARS = 12


class TenantSalts:
    def __init__(self, key: bytes | None = None):
        configured = os.environ.get(KEY_ENV)
        self._key = key if key is not None else (configured.encode() if configured else secrets.token_bytes(32))

    def salt_for(self, tenant: str) -> str:
        return hmac.new(self._key, tenant.encode(), hashlib.sha256).hexdigest()

    def label_for(self, name: str, kind: str = "tenant") -> str:
        """A short one-way name for traces and request ids of a tenant (or, `kind="cache_salt"`, of a
        client's cache salt): the same on every replica that shares the key, and no help in guessing
        the name or a salt."""
        message = _LABEL_PREFIX + kind.encode() + b"\x00" + name.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:LABEL_HEX_CHARS]

    def __repr__(self) -> str:
        return "TenantSalts(<key hidden>)"
