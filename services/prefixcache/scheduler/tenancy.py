"""Tenant names to cache salts, derived server-side so a client cannot pick another tenant's salt.

salt = hex(HMAC-SHA256(key, tenant)). The key comes from `PREFIXCACHE_TENANT_SALT_KEY` (give every
scheduler replica the same one, so a tenant's hashes agree across replicas); without it, each process
draws a random key, which isolates tenants just as well but only within one process.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

KEY_ENV = "PREFIXCACHE_TENANT_SALT_KEY"


class TenantSalts:
    def __init__(self, key: bytes | None = None):
        configured = os.environ.get(KEY_ENV)
        self._key = key if key is not None else (configured.encode() if configured else secrets.token_bytes(32))

    def salt_for(self, tenant: str) -> str:
        return hmac.new(self._key, tenant.encode(), hashlib.sha256).hexdigest()
