"""Server-side tenant salts: salt = hex(HMAC-SHA256(key, tenant)), so a client cannot pick another
tenant's salt, and one-way labels for traces from the same key.

The key comes from the tenants file's `salt_key`, else a key file (`--tenant-salt-key-file`, e.g. a
mounted Kubernetes Secret: read again when it changes, so a new key needs no restart and the blocks
hashed under the old one simply stop matching), else `PREFIXCACHE_TENANT_SALT_KEY` (give every
scheduler replica the same one, so a tenant's hashes agree across replicas); without any, each
process draws a random key, which isolates tenants just as well but only within one process.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

KEY_ENV = "PREFIXCACHE_TENANT_SALT_KEY"
# A label is an HMAC under the same key with this prefix: a tenant name never holds a control
# character (`config.py`), so no tenant's salt message can equal another's label message.
_LABEL_PREFIX = b"label\x00"
LABEL_HEX_CHARS = 12
CHECK_INTERVAL_S = 1.0
log = logging.getLogger(__name__)


def _signature(path: Path) -> tuple[int, int, int]:
    stat = os.stat(path)
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class TenantSalts:
    def __init__(self, key: bytes | None = None, key_file: Path | None = None,
                 check_interval_s: float = CHECK_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        """`key_file` (OSError or ValueError if it cannot be read now) is checked for a new key at most
        once per `check_interval_s`; a version that cannot be read keeps the key in force."""
        configured = os.environ.get(KEY_ENV)
        self._key_file = key_file
        self._check_interval_s = check_interval_s
        self._clock = clock
        if key_file is not None:
            self._signature = _signature(key_file)
            self._key = self._read_key_file()
            self._checked_at = clock()
        else:
            self._key = key if key is not None else (configured.encode() if configured else secrets.token_bytes(32))

    def _read_key_file(self) -> bytes:
        assert self._key_file is not None
        key = self._key_file.read_bytes().strip()
        if not key:
            raise ValueError(f"{self._key_file}: the salt key file is empty")
        return key

    def _current_key(self) -> bytes:
        if self._key_file is None or self._clock() - self._checked_at < self._check_interval_s:
            return self._key
        self._checked_at = self._clock()
        try:
            signature = _signature(self._key_file)
            if signature != self._signature:
                self._signature = signature  # a bad version is reported once, not at every check
                self._key = self._read_key_file()
                log.info("salt key file %s reloaded", self._key_file)  # never the key
        except (OSError, ValueError) as error:
            log.warning("salt key file: keeping the key in force: %s", error)
        return self._key

    def salt_for(self, tenant: str) -> str:
        return hmac.new(self._current_key(), tenant.encode(), hashlib.sha256).hexdigest()

    def label_for(self, name: str, kind: str = "tenant") -> str:
        """A short one-way name for traces and request ids of a tenant (or, `kind="cache_salt"`, of a
        client's cache salt): the same on every replica that shares the key, and no help in guessing
        the name or a salt."""
        message = _LABEL_PREFIX + kind.encode() + b"\x00" + name.encode()
        return hmac.new(self._current_key(), message, hashlib.sha256).hexdigest()[:LABEL_HEX_CHARS]

    def __repr__(self) -> str:
        return "TenantSalts(<key hidden>)"
