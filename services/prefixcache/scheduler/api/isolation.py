"""A request's cache isolation: the salt hashed into its first block.

With tenants configured (`prefixcache.scheduler.tenancy`), the salt is the authenticated tenant's,
and a request that names its own (`cache_salt` or `tenant`) is refused: either would let a client
claim another tenant's cache domain. Without, the local single-user default: the client may give a
`cache_salt`, or a `tenant` whose salt the server derives (`TenantSalts`), or neither.
"""
from __future__ import annotations

from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.scheduler.api.codec import InvalidRequest, PermissionDenied
from prefixcache.scheduler.tenancy import Identity, TenantSalts
from prefixcache.scheduler.tenancy.identity import Role

# Isolation keys are hashed into every request's first block and held per request: cap them well
# above any sensible key (a 256-bit salt is 64 hex characters) so that one request cannot make the
# server hash and hold megabytes.
MAX_CACHE_SALT_BYTES = 1024
MAX_TENANT_BYTES = 256


def request_salt(request: pb.GenerateRequest, tenants: TenantSalts, identity: Identity) -> str | None:
    """The salt `request`'s blocks are hashed with: its tenant's, its cache salt, or none.

    Raises PermissionDenied for an isolation field where the identity decides, InvalidRequest for
    one that is set but empty or longer than its limit. Neither value is quoted back: a salt is a
    secret, and a tenant name is as good as one."""
    if identity.role is not Role.ANONYMOUS:
        if field := request.WhichOneof("isolation"):
            raise PermissionDenied(field, "the server derives the cache salt from your credentials; "
                                          "leave cache_salt and tenant unset")
        if identity.role is Role.ADMIN:
            raise PermissionDenied("authorization", "an admin credential does not generate; use a tenant's")
        return identity.salt
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


def isolation_attributes(request: pb.GenerateRequest, tenants: TenantSalts, identity: Identity) -> dict[str, str]:
    """The span's `prefix_cache.isolation` (tenant, cache_salt or none) and, for the first two,
    `prefix_cache.tenant`: the domain's one-way label (`TenantSalts.label_for`), never the value itself."""
    if identity.role is not Role.ANONYMOUS:
        return {"prefix_cache.isolation": "tenant", "prefix_cache.tenant": identity.label}
    kind = request.WhichOneof("isolation")
    if kind is None:
        return {"prefix_cache.isolation": "none"}
    return {"prefix_cache.isolation": kind, "prefix_cache.tenant": tenants.label_for(getattr(request, kind), kind)}
