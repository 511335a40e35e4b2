"""From a call's credentials to who is calling: an `authorization: Bearer <API key>` header, else
the names of a verified client certificate, matched against the tenants file."""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixcache.scheduler.tenancy.config import Principal, TenantsConfig
from prefixcache.scheduler.tenancy.keys import matches
from prefixcache.scheduler.tenancy.limits import TenantLimits
from prefixcache.scheduler.tenancy.salts import TenantSalts

MAX_AUTHORIZATION_BYTES = 4096
# The common salt's message: a tenant name holds no control character, so none derives this one.
_SHARED_SALT_NAME = "\x00shared"


class Unauthenticated(Exception):
    """No credentials, or none the tenants file knows. The message names what was wrong, never a key."""


class Role(enum.Enum):
    ANONYMOUS = "anonymous"  # no tenants configured: the local single-user default, everything allowed
    TENANT = "tenant"
    ADMIN = "admin"


@dataclass(frozen=True)
class Identity:
    role: Role
    label: str = ""  # one-way (`TenantSalts.label_for`): for traces and request-id scopes; "" when anonymous
    salt: str | None = field(default=None, repr=False)  # a tenant's blocks' salt
    limits: TenantLimits = field(default_factory=TenantLimits)


ANONYMOUS = Identity(Role.ANONYMOUS)


def identify(config: TenantsConfig, salts: TenantSalts, authorization: str | None,
             peer_names: Sequence[str]) -> Identity:
    """The caller. Raises Unauthenticated when the call proves no configured identity."""
    principal = _by_api_key(config, authorization) if authorization is not None else _by_peer(config, peer_names)
    if principal.admin:
        return Identity(Role.ADMIN, salts.label_for(principal.name))
    salt = (salts.salt_for(_SHARED_SALT_NAME) if principal.shared
            else principal.salt if principal.salt is not None else salts.salt_for(principal.name))
    return Identity(Role.TENANT, salts.label_for(principal.name), salt, principal.limits.over(config.limits))


def _by_api_key(config: TenantsConfig, authorization: str) -> Principal:
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip() or len(authorization.encode()) > MAX_AUTHORIZATION_BYTES:
        raise Unauthenticated("authorization: expected 'Bearer <API key>'")
    found = [principal for principal in config.principals if matches(key.strip(), principal.api_key_hashes)]
    if not found:
        raise Unauthenticated("authorization: the API key is not valid")
    return found[0]


def _by_peer(config: TenantsConfig, peer_names: Sequence[str]) -> Principal:
    for principal in config.principals:
        if any(name in principal.client_names for name in peer_names):
            return principal
    if peer_names:
        raise Unauthenticated("the client certificate names no configured tenant")
    raise Unauthenticated("no credentials: send 'authorization: Bearer <API key>' metadata or a client certificate")
