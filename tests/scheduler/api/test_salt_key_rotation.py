"""A new tenant salt key reaches a running scheduler without a restart (a mounted Secret's file,
replaced the way the kubelet replaces it): a tenant's prefix hits before the rotation, misses once
after it (its old blocks no longer match), and hits again under the new key. And a second admins file
(the operator's) makes its key an admin beside the tenants file's, without touching that file."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from engine_harness import engine_api
from tenants_file import new_key, tenants_document, write_tenants

from prefixcache.client import EngineClient, build_request
from prefixcache.scheduler.tenancy import ConfigError, TenantRegistry, TenantSalts, hash_api_key
from prefixcache.tokenizer.text import TextTokenizer

PROMPT = list(range(400, 432))  # 8 blocks of 4 tokens


def write_key(path: Path, key: str) -> None:
    staged = path.with_suffix(".staged")
    staged.write_text(key)
    os.replace(staged, path)  # a new file moved over the old: what a Secret update does


def test_a_rotated_salt_key_file_changes_every_salt_without_a_restart(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    write_key(key_file, "first-key-" + "a" * 32)
    salts = TenantSalts(key_file=key_file, check_interval_s=0)
    before = salts.salt_for("acme")
    assert before == TenantSalts(key=b"first-key-" + b"a" * 32).salt_for("acme")
    write_key(key_file, "second-key-" + "b" * 32 + "\n")  # a trailing newline is not part of the key
    assert salts.salt_for("acme") == TenantSalts(key=b"second-key-" + b"b" * 32).salt_for("acme") != before
    write_key(key_file, "")  # a broken version keeps the key in force
    assert salts.salt_for("acme") == TenantSalts(key=b"second-key-" + b"b" * 32).salt_for("acme")


def test_a_tenants_cache_follows_the_salt_key_rotation(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    write_key(key_file, "first-key-" + "a" * 32)
    tenant_key = new_key()
    document = tenants_document({"acme": tenant_key})
    del document["salt_key"]  # the salts come from the key file
    registry = TenantRegistry(write_tenants(tmp_path / "tenants.json", document), check_interval_s=0,
                              fallback_salts=TenantSalts(key_file=key_file, check_interval_s=0))

    async def main() -> list[int]:
        async with engine_api(tokenizer, registry=registry) as (target, _), \
                EngineClient(target, api_key=tenant_key) as acme:
            async def cached() -> int:
                request = build_request(token_ids=PROMPT, max_tokens=2, temperature=0.0)
                return (await acme.complete(request)).usage.cached_tokens

            seen = [await cached(), await cached()]
            write_key(key_file, "second-key-" + "b" * 32)
            return [*seen, await cached(), await cached()]

    first, warm, rotated, warm_again = asyncio.run(asyncio.wait_for(main(), 60))
    assert first == 0 and warm > 0
    assert rotated == 0  # the blocks hashed under the old key no longer match
    assert warm_again == warm


def test_an_admins_file_adds_an_admin_and_is_reloaded(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    operator_key, tenant_key = new_key(), new_key()
    tenants = write_tenants(tmp_path / "tenants.json", tenants_document({"acme": tenant_key}))
    admins = write_tenants(tmp_path / "admins.json",
                           {"admins": [{"name": "prefixcache-operator", "api_keys": [hash_api_key(operator_key)]}]})
    registry = TenantRegistry(tenants, check_interval_s=0, admins_path=admins)

    async def main() -> grpc.StatusCode:
        async with engine_api(tokenizer, registry=registry) as (target, _), \
                EngineClient(target, api_key=operator_key) as operator:
            assert (await operator.cache_stats()).num_blocks > 0  # the whole cache: an admin
            write_tenants(admins, {"admins": []})
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await operator.cache_stats()
            return refused.value.code()

    assert asyncio.run(asyncio.wait_for(main(), 60)) == grpc.StatusCode.UNAUTHENTICATED


def test_an_admins_file_holds_admins_only(tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "tenants.json", tenants_document({"acme": new_key()}))
    sneaky = write_tenants(tmp_path / "admins.json", tenants_document({"mallory": new_key()}))
    with pytest.raises(ConfigError, match="admins file: holds admins only"):
        TenantRegistry(tenants, admins_path=sneaky)
