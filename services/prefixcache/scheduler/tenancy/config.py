"""The tenants file: who may call the Engine API, with which credentials, hashing with which salt.

    {
      "salt_key": "<32+ random bytes, e.g. openssl rand -hex 32>",
      "limits": {"max_in_flight": 16, "max_waiting": 64},
      "tenants": [
        {"name": "acme", "api_keys": ["sha256:<hex>"], "client_names": ["acme.clients.example"]},
        {"name": "globex", "api_keys": ["sha256:<hex>"], "limits": {"max_in_flight": 4}},
        {"name": "docs-bot", "api_keys": ["sha256:<hex>"], "shared": true}
      ],
      "admins": [{"name": "ops", "api_keys": ["sha256:<hex>"]}]
    }

A tenant's blocks are hashed with its `salt` if given (to rotate one tenant's salt), else with
HMAC(salt_key, name); tenants marked `shared` all use one common salt and so share their cached
prefixes with each other (and can probe each other's prompts: they opted in). `client_names` are
names a verified client certificate carries (a DNS or URI subject alternative name, or the common
name when it has none). Admins generate nothing: they read the whole cache's statistics and reset it.

Problems name the field by position (`tenants[2].api_keys[0]`), never a value: a tenant's name may
be a secret of its own.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from prefixcache.scheduler.tenancy.keys import is_key_hash
from prefixcache.scheduler.tenancy.limits import TenantLimits

MAX_NAME_BYTES = 256
MAX_SALT_BYTES = 1024
MIN_SALT_KEY_CHARS = 16
_TOP_LEVEL = {"salt_key", "limits", "tenants", "admins"}
_TENANT_FIELDS = {"name", "api_keys", "client_names", "salt", "shared", "limits"}
_ADMIN_FIELDS = {"name", "api_keys", "client_names"}
_LIMIT_FIELDS = {"max_in_flight", "max_waiting"}


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Principal:
    """A tenant or an admin, and the credentials that identify it."""

    name: str = field(repr=False)
    api_key_hashes: tuple[str, ...] = field(default=(), repr=False)
    client_names: tuple[str, ...] = field(default=(), repr=False)
    admin: bool = False
    salt: str | None = field(default=None, repr=False)
    shared: bool = False
    limits: TenantLimits = field(default_factory=TenantLimits)


@dataclass(frozen=True)
class TenantsConfig:
    tenants: tuple[Principal, ...] = ()
    admins: tuple[Principal, ...] = ()
    salt_key: bytes | None = field(default=None, repr=False)
    limits: TenantLimits = field(default_factory=TenantLimits)

    @property
    def principals(self) -> tuple[Principal, ...]:
        return (*self.tenants, *self.admins)


def parse_config(text: str | bytes) -> TenantsConfig:
    """The tenants file's content, checked; ConfigError naming every problem."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError([f"not JSON ({type(error).__name__} at {getattr(error, 'pos', '?')})"]) from None
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        raise ConfigError(["the file must hold a JSON object"])
    problems += [f"{name}: unknown field" for name in raw if name not in _TOP_LEVEL]
    salt_key = raw.get("salt_key")
    if salt_key is not None and (not isinstance(salt_key, str) or len(salt_key) < MIN_SALT_KEY_CHARS):
        problems.append(f"salt_key: a string of at least {MIN_SALT_KEY_CHARS} characters")
    limits = _limits(raw.get("limits"), "limits", problems)
    tenants = _principals(raw.get("tenants", []), "tenants", _TENANT_FIELDS, problems)
    admins = _principals(raw.get("admins", []), "admins", _ADMIN_FIELDS, problems, admin=True)
    problems += _duplicates((*tenants, *admins))
    if problems:
        raise ConfigError(problems)
    return TenantsConfig(tenants=tenants, admins=admins, limits=limits,
                         salt_key=salt_key.encode() if salt_key is not None else None)


def with_admins_of(config: TenantsConfig, admins_file: TenantsConfig) -> TenantsConfig:
    """`config` with the admins of a second file, which must hold admins only (ConfigError otherwise)."""
    problems = []
    if admins_file.tenants or admins_file.salt_key is not None:
        problems.append("admins file: holds admins only (no tenants, no salt_key)")
    problems += _duplicates((*config.principals, *admins_file.admins))
    if problems:
        raise ConfigError(problems)
    return replace(config, admins=(*config.admins, *admins_file.admins))


def _principals(raw: Any, where: str, fields: set[str], problems: list[str], admin: bool = False) -> tuple[Principal, ...]:
    if not isinstance(raw, list):
        problems.append(f"{where}: must be a list")
        return ()
    principals = []
    for index, entry in enumerate(raw):
        at = f"{where}[{index}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{at}: must be an object")
            continue
        problems += [f"{at}.{name}: unknown field" for name in entry if name not in fields]
        name = entry.get("name")
        if not isinstance(name, str) or not 0 < len(name.encode()) <= MAX_NAME_BYTES or not name.isprintable():
            problems.append(f"{at}.name: 1 to {MAX_NAME_BYTES} bytes of printable text")
        keys = _strings(entry.get("api_keys", []), f"{at}.api_keys", problems)
        problems += [f"{at}.api_keys[{i}]: not a key hash (sha256:<64 lowercase hex digits>)"
                     for i, key in enumerate(keys) if not is_key_hash(key)]
        client_names = _strings(entry.get("client_names", []), f"{at}.client_names", problems)
        if not keys and not client_names:
            problems.append(f"{at}: give api_keys or client_names (a principal nobody can authenticate as)")
        salt = entry.get("salt")
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt.encode()) <= MAX_SALT_BYTES):
            problems.append(f"{at}.salt: 1 to {MAX_SALT_BYTES} bytes")
        shared = entry.get("shared", False)
        if not isinstance(shared, bool):
            problems.append(f"{at}.shared: true or false")
        elif shared and salt is not None:
            problems.append(f"{at}: a shared tenant uses the common salt; leave out its salt")
        principals.append(Principal(name=name if isinstance(name, str) else "", api_key_hashes=tuple(keys),
                                    client_names=tuple(client_names), admin=admin,
                                    salt=salt if isinstance(salt, str) else None, shared=shared is True,
                                    limits=_limits(entry.get("limits"), f"{at}.limits", problems)))
    return tuple(principals)


def _strings(raw: Any, where: str, problems: list[str]) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(item, str) and item for item in raw):
        problems.append(f"{where}: must be a list of non-empty strings")
        return []
    return raw


def _limits(raw: Any, where: str, problems: list[str]) -> TenantLimits:
    if raw is None:
        return TenantLimits()
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be an object")
        return TenantLimits()
    problems += [f"{where}.{name}: unknown field" for name in raw if name not in _LIMIT_FIELDS]
    values = {}
    for name in _LIMIT_FIELDS & raw.keys():
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{where}.{name}: a positive integer")
        else:
            values[name] = value
    return TenantLimits(**values)


def _duplicates(principals: tuple[Principal, ...]) -> list[str]:
    """A name, key or client name given to two principals would make identities ambiguous."""
    problems = []
    for what, values in (("name", [p.name for p in principals]),
                         ("API key", [k for p in principals for k in p.api_key_hashes]),
                         ("client name", [n for p in principals for n in p.client_names])):
        if len(set(values)) != len(values):
            problems.append(f"the same {what} is given twice")
    return problems
