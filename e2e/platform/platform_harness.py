"""Helpers of the platform e2e tests: start and stop a local platform, restart its worker, one event loop,
idle polling."""
from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from prefixcache.client import EngineClient
from prefixcache.launcher import LocalPlatform, PlatformConfig, free_port

# 113 blocks of 16 tokens: room for 16 streams or two 1,000-token prompts sharing a prefix, and small
# enough that the eviction test fills it with two more.
KV_CACHE_MEMORY = "80MiB"
# 16 running and 16 waiting at most: room for 16 concurrent arrivals, few enough for the queue-full test.
SCHEDULER_ARGS = ["--max-num-seqs", "16", "--max-waiting", "16"]
# Long enough for a loaded CI machine to finish the in-flight stream of test_shutdown.
GRACE_S = 30.0
# Every service prints its spans to its log (read by test_tracing), exported within 0.1 s.
TRACING_ENV = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
# grpc.aio binds its poller to the first event loop it sees: every test runs on this one.
_loop = asyncio.new_event_loop()
# Platforms started here and not yet stopped: every test checks each of them for leaked blocks.
running_platforms: list[LocalPlatform] = []


def run(coroutine):
    return _loop.run_until_complete(coroutine)


def start_platform(log_dir: Path, extra_scheduler_args: list[str] = (), kv_cache_memory: str = KV_CACHE_MEMORY,
                   worker_args: list[str] = (), tokenizer_args: list[str] = ()) -> LocalPlatform:
    from prefixcache.model_store.store import ensure_default_model

    platform = LocalPlatform(
        PlatformConfig(
            model_dir=ensure_default_model(),
            log_dir=log_dir,
            engine_port=free_port(),
            engine_host="127.0.0.1",
            kv_cache_memory=kv_cache_memory,
            scheduler_args=[*SCHEDULER_ARGS, "--metrics-port", str(free_port()), *extra_scheduler_args],
            worker_args=list(worker_args),
            tokenizer_args=list(tokenizer_args),
            env=TRACING_ENV,
            grace_s=GRACE_S,
        )
    )
    platform.start()
    try:
        run(platform.wait_ready(timeout_s=240))
    except BaseException:
        platform.stop()
        raise
    running_platforms.append(platform)
    return platform


def stop_platform(platform: LocalPlatform) -> None:
    running_platforms.remove(platform)
    statuses = platform.stop()
    # SIGTERM is a clean shutdown for every service: exit status 0.
    assert statuses == {"scheduler": 0, "worker": 0, "tokenizer": 0}, (
        f"{statuses}\n" + "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in platform.services)
    )


def restart_worker(platform: LocalPlatform) -> None:
    """Start the worker again on the same port (after it died or was killed)."""
    platform.worker.kill()
    platform.worker.start()


def scrape_metrics(platform: LocalPlatform, service: str = "scheduler") -> dict[str, float]:
    """A service's Prometheus samples, `name{labels}` -> value, without the `model_name` label every
    sample carries (checked to be set, once the service knows its model)."""
    args = {"scheduler": platform.config.scheduler_args, "worker": platform.config.worker_args,
            "tokenizer": platform.config.tokenizer_args}[service]
    url = f"http://127.0.0.1:{args[args.index('--metrics-port') + 1]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if "model_name" in labels:
                assert labels.pop("model_name"), sample
            shown = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
            samples[f"{sample.name}{{{shown}}}" if shown else sample.name] = sample.value
    return samples


async def wait_idle(target: str, timeout_s: float = 30.0):
    """Poll the cache stats until no request runs or waits and no block is held; return them."""
    deadline = time.monotonic() + timeout_s
    async with EngineClient(target) as engine:
        while True:
            stats = await engine.cache_stats()
            idle = stats.running_requests == 0 and stats.waiting_requests == 0 and stats.used_blocks == 0
            if idle or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.1)
