"""Tenant names map to secret, stable, distinct salts."""
from __future__ import annotations

import hashlib
import hmac

import pytest

from prefixcache.scheduler.tenancy import KEY_ENV, TenantSalts


def test_salt_is_the_hmac_of_the_tenant_under_the_configured_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "replica-shared-key")
    salts = TenantSalts()
    expected = hmac.new(b"replica-shared-key", b"acme", hashlib.sha256).hexdigest()
    assert salts.salt_for("acme") == expected == TenantSalts().salt_for("acme")  # same key: same salt
    assert salts.salt_for("globex") != expected


def test_without_a_key_each_process_draws_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert TenantSalts().salt_for("acme") != TenantSalts().salt_for("acme")
