"""Who is calling the Engine API: tenants and admins configured in a file, the credentials that
identify them (API keys kept as hashes, client certificate names), the salt each tenant's blocks
are hashed with, and each tenant's limits. No gRPC here: the servicer hands over the call's
`authorization` metadata and its verified peer names."""
from prefixcache.scheduler.tenancy.config import ConfigError, Principal, TenantsConfig, parse_config
from prefixcache.scheduler.tenancy.identity import ANONYMOUS, Identity, Unauthenticated, identify
from prefixcache.scheduler.tenancy.keys import hash_api_key
from prefixcache.scheduler.tenancy.limits import TenantLimits
from prefixcache.scheduler.tenancy.registry import TenantRegistry
from prefixcache.scheduler.tenancy.salts import KEY_ENV, TenantSalts

__all__ = [
    "ANONYMOUS",
    "KEY_ENV",
    "ConfigError",
    "Identity",
    "Principal",
    "TenantLimits",
    "TenantRegistry",
    "TenantSalts",
    "TenantsConfig",
    "Unauthenticated",
    "hash_api_key",
    "identify",
    "parse_config",
]
