"""The operator's admin credential for the Engine API of stacks with tenants (their `GetCacheStats`
answers a tenant with its own counters only; the cache-health poller needs the whole cache's).

The key is drawn at random when the operator starts and lives only in its memory: never logged, never
written to the cluster. What the cluster gets is its hash, in an admins file (the tenants file's
format, admins only) that the renderer puts in a ConfigMap `<name>-operator-admin`, mounted into the
schedulers (`--admins`), which read it again when it changes. The user's tenants Secret stays the
user's: the operator neither reads nor edits it. A restarted operator draws a new key and rewrites
the ConfigMap; until the kubelet has refreshed the mounted copy (about a minute), its reads are
refused and reported per pod.
"""
from __future__ import annotations

import hashlib
import secrets

# The scheduler's API-key hash format (prefixcache.scheduler.tenancy.keys, which the operator may not
# import; tests/operator/test_cache_health.py checks that both agree).
KEY_HASH_PREFIX = "sha256:"
ADMIN_NAME = "prefixcache-operator"


def new_admin_key() -> str:
    return secrets.token_hex(32)


def key_hash(key: str) -> str:
    return KEY_HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()
