"""A request's cache isolation: the salt hashed into its first block, given by the client as
`cache_salt` or derived server-side from its `tenant`, so a client cannot pick another tenant's salt.

salt = hex(HMAC-SHA256(key, tenant)). The key comes from `PREFIXCACHE_TENANT_SALT_KEY` (give every
scheduler replica the same one, so a tenant's hashes agree across replicas); without it, each process
draws a random key, which isolates tenants just as well but only within one process.

A request's span names its isolation domain by a label, a keyed one-way digest of the tenant (or of
the cache salt) under another domain of the same key: it tells requests of one tenant from another's,
cannot be turned back into the tenant or the salt, and cannot be guessed offline without the key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.scheduler.api.codec import InvalidRequest

KEY_ENV = "PREFIXCACHE_TENANT_SALT_KEY"
# Isolation keys are hashed into every request's first block and held per request: cap them well
# above any sensible key (a 256-bit salt is 64 hex characters) so that one request cannot make the
# server hash and hold megabytes.
MAX_CACHE_SALT_BYTES = 1024
MAX_TENANT_BYTES = 256


class TenantSalts:
    def __init__(self, key: bytes | None = None):
        configured = os.environ.get(KEY_ENV)
        self._key = key if key is not None else (configured.encode() if configured else secrets.token_bytes(32))

    def salt_for(self, tenant: str) -> str:
        return hmac.new(self._key, tenant.encode(), hashlib.sha256).hexdigest()

    def label_for(self, kind: str, value: str) -> str:
        """The span label of a tenant or cache salt (`kind`): 64 bits of a digest no salt is made of."""
        message = b"prefixcache span label\0" + kind.encode() + b"\0" + value.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:16]


def request_salt(request: pb.GenerateRequest, tenants: TenantSalts) -> str | None:
    """The salt `request`'s blocks are hashed with: its cache salt, its tenant's, or none.

    Raises InvalidRequest for a key that is set but empty or longer than its limit. Neither value
    is quoted back: a salt is a secret, and a tenant name is as good as one."""
    for name, limit in (("cache_salt", MAX_CACHE_SALT_BYTES), ("tenant", MAX_TENANT_BYTES)):
        if not request.HasField(name):
            continue
        size = len(getattr(request, name).encode())
        if size == 0:
            raise InvalidRequest(name, "must not be empty when set")
        if size > limit:
            raise InvalidRequest(name, f"{size} bytes, more than the {limit} allowed")
    if request.HasField("cache_salt"):
        return request.cache_salt
    if request.HasField("tenant"):
        return tenants.salt_for(request.tenant)
    return None


def isolation_attributes(request: pb.GenerateRequest, tenants: TenantSalts) -> dict[str, str]:
    """The span's `prefix_cache.isolation` (tenant, cache_salt or none) and, for the first two,
    `prefix_cache.tenant`: the domain's label (see the module's docstring), never the value itself."""
    kind = request.WhichOneof("isolation")
    if kind is None:
        return {"prefix_cache.isolation": "none"}
    return {"prefix_cache.isolation": kind, "prefix_cache.tenant": tenants.label_for(kind, getattr(request, kind))}
