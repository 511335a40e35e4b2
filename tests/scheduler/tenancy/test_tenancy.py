"""The tenants file and identities: what a file may say, which credentials prove whom, which salt a
tenant gets, and reloading a changed file without a restart."""
from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pytest
from tenants_file import SALT_KEY, new_key, tenants_document, write_tenants

from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.tenancy import (
    ConfigError,
    TenantLimits,
    TenantRegistry,
    TenantSalts,
    Unauthenticated,
    hash_api_key,
    identify,
    parse_config,
)
from prefixcache.scheduler.tenancy.identity import Role
from prefixcache.scheduler.tenancy.keys import matches


def config_of(document: dict):
    return parse_config(json.dumps(document))


def test_a_tenant_is_identified_by_its_key_and_gets_the_hmac_salt_under_the_files_key() -> None:
    acme, globex = new_key(), new_key()
    config = config_of(tenants_document({"acme": acme, "globex": globex}))
    salts = TenantSalts(SALT_KEY.encode())
    identity = identify(config, salts, f"Bearer {acme}", [])
    assert identity.role is Role.TENANT
    assert identity.salt == hmac.new(SALT_KEY.encode(), b"acme", hashlib.sha256).hexdigest()
    assert identify(config, salts, f"bearer {globex}", []).salt == salts.salt_for("globex") != identity.salt
    # The label is one-way: neither the name nor the salt, nor a prefix of the salt.
    assert identity.label not in ("acme", identity.salt[: len(identity.label)]) and "acme" not in repr(identity)
    assert identity.salt not in repr(identity)


@pytest.mark.parametrize("authorization, message", [
    (None, "no credentials"),
    ("Bearer ", "expected 'Bearer <API key>'"),
    ("Basic dXNlcjpwYXNz", "expected 'Bearer <API key>'"),
    ("Bearer " + "0" * 64, "not valid"),
])
def test_anything_but_a_configured_key_is_unauthenticated(authorization: str | None, message: str) -> None:
    config = config_of(tenants_document({"acme": new_key()}))
    with pytest.raises(Unauthenticated, match=message) as refused:
        identify(config, TenantSalts(), authorization, [])
    assert "0" * 64 not in str(refused.value)  # a presented key is never echoed


def test_the_stored_hash_is_not_itself_a_key() -> None:
    key = new_key()
    config = config_of(tenants_document({"acme": key}))
    with pytest.raises(Unauthenticated):
        identify(config, TenantSalts(), f"Bearer {hash_api_key(key)}", [])
    assert matches(key, ["sha256:" + "0" * 64, hash_api_key(key)]) and not matches(key + "x", [hash_api_key(key)])


def test_a_verified_client_certificate_name_identifies_a_tenant_and_a_key_takes_precedence() -> None:
    key = new_key()
    document = tenants_document({"acme": key, "globex": new_key()},
                                acme={"client_names": ["acme.clients.example"]})
    config, salts = config_of(document), TenantSalts()
    assert identify(config, salts, None, ["other", "acme.clients.example"]).salt == salts.salt_for("acme")
    with pytest.raises(Unauthenticated, match="names no configured tenant"):
        identify(config, salts, None, ["mallory.example"])
    with pytest.raises(Unauthenticated):  # a header that is there decides, even beside a good certificate
        identify(config, salts, "Bearer wrong", ["acme.clients.example"])


def test_explicit_shared_and_admin_identities() -> None:
    keys = {name: new_key() for name in ("rotated", "bot-a", "bot-b", "plain", "ops")}
    document = tenants_document({name: keys[name] for name in ("rotated", "bot-a", "bot-b", "plain")},
                                admins={"ops": keys["ops"]}, rotated={"salt": "explicit-v2"},
                                **{"bot-a": {"shared": True}, "bot-b": {"shared": True}})
    config, salts = config_of(document), TenantSalts(b"k" * 32)
    who = {name: identify(config, salts, f"Bearer {key}", []) for name, key in keys.items()}
    assert who["rotated"].salt == "explicit-v2"
    assert who["bot-a"].salt == who["bot-b"].salt not in (salts.salt_for("bot-a"), salts.salt_for("bot-b"))
    assert who["plain"].salt not in (who["bot-a"].salt, who["rotated"].salt)
    assert who["ops"].role is Role.ADMIN and who["ops"].salt is None


def test_limits_default_to_a_share_of_the_schedulers_and_a_tenant_may_override_them() -> None:
    keys = {"acme": new_key(), "globex": new_key()}
    document = tenants_document(keys, limits={"max_waiting": 8}, globex={"limits": {"max_in_flight": 2}})
    config = config_of(document)
    acme, globex = (identify(config, TenantSalts(), f"Bearer {keys[name]}", []) for name in ("acme", "globex"))
    scheduler = SchedulerConfig(max_num_seqs=32, max_waiting=256)
    assert acme.limits.resolved(scheduler) == (16, 8)
    assert globex.limits.resolved(scheduler) == (2, 8)
    assert TenantLimits().resolved(SchedulerConfig(max_num_seqs=1, max_waiting=1)) == (1, 1)


@pytest.mark.parametrize("document, problem", [
    ({"tenants": [{"name": "acme"}]}, "tenants[0]: give api_keys or client_names"),
    ({"tenants": [{"name": "acme", "api_keys": ["my-plain-secret-key"]}]}, "tenants[0].api_keys[0]: not a key hash"),
    ({"tenants": [{"name": "a\u0000b", "client_names": ["x"]}]}, "tenants[0].name"),
    ({"tenants": [{"name": "acme", "client_names": ["x"], "salt": "s", "shared": True}]}, "leave out its salt"),
    ({"tenants": [{"name": "acme", "client_names": ["x"], "limits": {"max_in_flight": 0}}]},
     "tenants[0].limits.max_in_flight"),
    ({"tenants": [{"name": "a", "client_names": ["x"]}, {"name": "b", "client_names": ["x"]}]},
     "the same client name is given twice"),
    ({"salt_key": "short"}, "salt_key"),
    ({"tenant": []}, "tenant: unknown field"),
    ({"admins": [{"name": "ops", "client_names": ["o"], "shared": True}]}, "admins[0].shared: unknown field"),
])
def test_a_bad_file_names_the_field_and_never_quotes_a_value(document: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_of(document)
    assert problem in str(refused.value)
    for secret in ("my-plain-secret-key", "short", "acme"):
        assert secret not in str(refused.value)


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_last_good(tmp_path: Path) -> None:
    old, new = new_key(), new_key()
    path = write_tenants(tmp_path / "tenants.json", tenants_document({"acme": old}))
    now = [0.0]
    registry = TenantRegistry(path, check_interval_s=1.0, clock=lambda: now[0])
    salt = registry.identify(f"Bearer {old}", []).salt

    write_tenants(path, tenants_document({"acme": new}))  # the key rotated
    assert registry.identify(f"Bearer {old}", []).salt == salt  # not looked at again within the interval
    now[0] += 1.0
    with pytest.raises(Unauthenticated):
        registry.identify(f"Bearer {old}", [])
    assert registry.identify(f"Bearer {new}", []).salt == salt  # same name, same key: same salt

    path.write_text("{ not json")  # a broken edit: the configuration in force stays
    now[0] += 1.0
    assert registry.identify(f"Bearer {new}", []).salt == salt

    rotated = tenants_document({"acme": new}, acme={"salt": "acme-v2"})
    write_tenants(path, rotated)
    now[0] += 1.0
    assert registry.identify(f"Bearer {new}", []).salt == "acme-v2"


def test_without_a_salt_key_in_the_file_a_reload_keeps_every_salt(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("PREFIXCACHE_TENANT_SALT_KEY", raising=False)
    key = new_key()
    document = tenants_document({"acme": key})
    del document["salt_key"]
    path = write_tenants(tmp_path / "tenants.json", document)
    registry = TenantRegistry(path, check_interval_s=0)
    salt = registry.identify(f"Bearer {key}", []).salt
    write_tenants(path, {**document, "limits": {"max_in_flight": 3}})
    assert registry.identify(f"Bearer {key}", []).limits.max_in_flight == 3
    assert registry.identify(f"Bearer {key}", []).salt == salt
