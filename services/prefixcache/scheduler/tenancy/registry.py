"""The tenants file (and an optional admins file beside it), read again when either changes: keys
and salts rotate without a restart.

The admins file has the tenants file's format with admins only; it lets a second party that may not
edit the tenants file (the operator, which reads the whole cache's statistics) hold an admin key.

Each identification first checks (at most once per `check_interval_s`) whether the file was replaced
or rewritten; a mounted Kubernetes Secret changes by a symlink swap, which a `stat` sees. A file that
no longer parses keeps the last good configuration in force, with a warning naming the problem.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixcache.scheduler.tenancy.config import ConfigError, TenantsConfig, parse_config, with_admins_of
from prefixcache.scheduler.tenancy.identity import Identity, identify
from prefixcache.scheduler.tenancy.salts import TenantSalts

log = logging.getLogger(__name__)
CHECK_INTERVAL_S = 1.0


def _signature(*paths: Path | None) -> tuple[tuple[int, int, int], ...]:
    return tuple((stat.st_ino, stat.st_mtime_ns, stat.st_size) for stat in (os.stat(p) for p in paths if p))


class TenantRegistry:
    def __init__(self, path: Path, check_interval_s: float = CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, admins_path: Path | None = None,
                 fallback_salts: TenantSalts | None = None) -> None:
        """Reads `path` (and `admins_path`) now: ConfigError (or OSError) if either is not valid.
        `fallback_salts` hash the tenants' blocks when the file has no salt_key."""
        self.path = path
        self.admins_path = admins_path
        self._check_interval_s = check_interval_s
        self._clock = clock
        # Without a salt_key in the file, one key for the process's lifetime (or the key file's): a
        # reload must not change every tenant's salt.
        self._fallback_salts = fallback_salts or TenantSalts()
        self._signature = _signature(path, admins_path)
        self._config, self._salts = self._load()
        self._checked_at = clock()

    def _load(self) -> tuple[TenantsConfig, TenantSalts]:
        config = parse_config(self.path.read_bytes())
        if self.admins_path is not None:
            config = with_admins_of(config, parse_config(self.admins_path.read_bytes()))
        return config, TenantSalts(config.salt_key) if config.salt_key is not None else self._fallback_salts

    @property
    def config(self) -> TenantsConfig:
        self._refresh()
        return self._config

    def identify(self, authorization: str | None, peer_names: Sequence[str]) -> Identity:
        """Raises Unauthenticated."""
        self._refresh()
        return identify(self._config, self._salts, authorization, peer_names)

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked_at < self._check_interval_s:
            return
        self._checked_at = now
        try:
            signature = _signature(self.path, self.admins_path)
        except OSError as error:
            log.warning("tenants file %s: keeping the configuration in force: %s", self.path, error)
            return
        if signature == self._signature:
            return
        self._signature = signature  # a bad version is reported once, not at every check
        try:
            self._config, self._salts = self._load()
        except (OSError, ConfigError) as error:
            log.warning("tenants file %s: keeping the configuration in force: %s", self.path, error)
            return
        log.info("tenants file %s reloaded: %d tenants, %d admins", self.path, len(self._config.tenants),
                 len(self._config.admins))
