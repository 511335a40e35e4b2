"""A private local platform for the benchmark: the services engineer's launcher (the one behind
`prefixcache serve`) on free loopback ports, its logs in a temporary folder."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.launcher import LocalPlatform


@dataclass(frozen=True)
class LocalSettings:
    """What the benchmark's local platforms run with; both modes get the same except the cache."""

    model_dir: Path | None = None  # None: the embedded model (pulled on first use)
    dtype: str = "float32"
    kv_cache_memory: str = "1GiB"  # worker's KV budget; a small one makes `thrash` cheap
    scheduler_args: tuple[str, ...] = ()  # extra scheduler flags, e.g. ("--max-num-seqs", "16")
    startup_timeout_s: float = 300.0


@contextlib.asynccontextmanager
async def local_platform(settings: LocalSettings, prefix_caching: bool) -> AsyncIterator[str]:
    """Start tokenizer, worker and scheduler as separate processes; yield the Engine's HOST:PORT."""
    # Imported here, so that the CLI's `bench --help` loads no gRPC.
    from prefixcache.launcher import LocalPlatform, PlatformConfig, free_port
    from prefixcache.model_store.store import ensure_default_model

    log_dir = Path(tempfile.mkdtemp(prefix="prefixcache-bench-"))
    platform = LocalPlatform(
        PlatformConfig(
            model_dir=settings.model_dir or ensure_default_model(),
            log_dir=log_dir,
            engine_port=free_port(),
            engine_host="127.0.0.1",
            dtype=settings.dtype,
            kv_cache_memory=settings.kv_cache_memory,
            scheduler_args=[*settings.scheduler_args, *([] if prefix_caching else ["--no-prefix-caching"])],
        )
    )
    platform.start()
    keep_logs = False
    try:
        try:
            await platform.wait_ready(settings.startup_timeout_s)
        except RuntimeError as error:
            keep_logs = True
            raise RuntimeError(f"the local platform did not start: {error}\n(logs kept in {log_dir})") from None
        yield platform.engine_address
    finally:
        try:
            await _stop(platform)
        finally:
            if not keep_logs:
                shutil.rmtree(log_dir, ignore_errors=True)


async def _stop(platform: LocalPlatform) -> None:
    """`platform.stop()` in a thread, run to its end even if the caller is cancelled meanwhile (the
    cancellation is then passed on): the services must be gone before their log folder is."""
    stopping = asyncio.ensure_future(asyncio.to_thread(platform.stop))
    try:
        await asyncio.shield(stopping)
    except asyncio.CancelledError:
        await stopping
        raise
