"""`prefixcache bench` against the real local platform: three services as separate processes, real
gRPC, the embedded model. Small sizes and concurrency 1 make every cache hit predictable."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from prefixcache.bench.local_platform import LocalSettings, local_platform
from prefixcache.bench.session import BenchConfig, run_session
from prefixcache.bench.workloads import IntRange, WorkloadOptions
from prefixcache.cli import main as cli
from prefixcache.client import EngineClient

pytestmark = pytest.mark.slow

BLOCK = 16
# 18 MiB of float32 KV (46,080 bytes per token) is about 25 blocks: room for any one request here,
# too little for the thrash prefixes.
SETTINGS = LocalSettings(kv_cache_memory="18MiB")
OPTIONS = WorkloadOptions(num_requests=3, prefix_len=64, suffix_len=IntRange(8, 16), output_len=3, turns=IntRange(2, 3))


@pytest.fixture(scope="module")
def engines():
    """{"cache": target, "no_cache": target}: two local platforms, started together."""
    platforms = {"cache": local_platform(SETTINGS, prefix_caching=True),
                 "no_cache": local_platform(SETTINGS, prefix_caching=False)}

    async def each(step):
        return await asyncio.gather(*(step(p) for p in platforms.values()))

    # One loop for both ends: asyncio.run would finalize the context managers as it closed.
    loop = asyncio.new_event_loop()
    targets = loop.run_until_complete(each(lambda p: p.__aenter__()))
    yield dict(zip(platforms, targets))
    loop.run_until_complete(each(lambda p: p.__aexit__(None, None, None)))
    loop.close()


def on_engine(target, call):
    """`call(client)` on a client of the Engine at `target`, e.g. `on_engine(target, EngineClient.cache_stats)`."""

    async def main():
        async with EngineClient(target) as engine:
            return await call(engine)

    return asyncio.run(main())


def cache_stats(target):
    return on_engine(target, EngineClient.cache_stats)


def run_one(target, workload, options):
    config = BenchConfig(workloads=(workload,), options=options, concurrency=1, target=target,
                         reset_between_workloads=False, warmup_requests=0, show_progress=False)
    assert on_engine(target, EngineClient.reset_prefix_cache)  # an empty cache; the reset itself is not counted below
    before = cache_stats(target)
    outcome = asyncio.run(run_session(config))
    after = cache_stats(target)
    return outcome, after.hit_tokens - before.hit_tokens, after.evictions - before.evictions


def expected_hits(workload, requests):
    """Hand-computed cached tokens per request at concurrency 1 on an empty cache."""
    if workload in ("shared-system-prompt", "few-shot"):
        return [0] + [OPTIONS.prefix_len // BLOCK * BLOCK] * (len(requests) - 1)
    if workload == "multi-turn":  # turn k reuses the full blocks of turn k-1's prompt
        by_id = {r.request_id: r for r in requests}
        return [len(by_id[r.after].prompt_token_ids) // BLOCK * BLOCK if r.after else 0 for r in requests]
    return [0] * len(requests)  # unique, thrash


@pytest.mark.parametrize("workload, options", [
    ("shared-system-prompt", OPTIONS),
    ("multi-turn", replace(OPTIONS, num_requests=5, suffix_len=IntRange(16, 24))),
    ("few-shot", OPTIONS),
    ("unique", OPTIONS),
    # 128-token prefixes: the ~25-block pool holds 3, so auto-sizing picks 5 and visits each three times.
    ("thrash", replace(OPTIONS, prefix_len=128)),
])
def test_report_totals_match_the_servers_usage(engines, workload, options):
    outcome, server_hit_tokens, server_evictions = run_one(engines["cache"], workload, options)
    summary = outcome.results[workload].summaries["cache"]
    records = outcome.results[workload].records["cache"]
    requests = outcome.requests[workload]
    assert summary.completed == len(requests) and summary.failed == 0
    assert summary.cached_tokens == sum(r.cached_tokens for r in records) == server_hit_tokens
    assert summary.prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert [r.cached_tokens for r in records] == expected_hits(workload, requests)
    assert summary.output_tokens == options.output_len * len(requests)  # greedy with ignore_eos
    assert summary.evictions == server_evictions
    if workload == "thrash":
        prefixes = outcome.description["options"]["thrash_prefixes"]
        assert prefixes == 5 and len(requests) == 15 and summary.evictions > 0
        assert summary.miss_reasons == {"cold": 5, "evicted": 10}  # evictions dominate
    if workload == "unique":
        assert summary.miss_reasons == {"cold": len(requests)}


def test_cli_compare_no_cache_reports_ratios(engines, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--target", engines["cache"], "--compare-no-cache", "--no-cache-target", engines["no_cache"],
                   "--workload", "shared-system-prompt", "--num-requests", "3", "--concurrency", "1",
                   "--prefix-len", "64", "--suffix-len", "8:16", "--output-len", "3", "--warmup", "1",
                   "--tenants", "1", "--json", str(out), "--no-progress"])
    assert rc == 0
    assert "cache/no cache" in capsys.readouterr().out
    report = json.loads(out.read_text())["workloads"]["shared-system-prompt"]
    assert report["no_cache"]["cached_tokens"] == 0 and report["no_cache"]["miss_reasons"] == {"disabled": 3}
    assert report["cache"]["cached_tokens"] == 2 * 64  # the fresh salt makes the first request miss
    assert report["cache"]["prompt_tokens"] == report["no_cache"]["prompt_tokens"]
    assert report["ratio"]["prompt_tokens"] == 1.0 and report["ratio"]["hit_rate"] is None
    # Swapped endpoints are refused: the no-cache run must not silently use a caching engine.
    assert cli.main(["bench", "--target", engines["no_cache"], "--workload", "unique", "--num-requests", "1",
                     "--no-progress"]) == 2
    assert "prefix caching on" in capsys.readouterr().err


def test_cli_without_a_target_starts_a_fresh_platform_per_mode(tmp_path, capsys):
    """The default path: no --target, so each mode gets its own local platform (the no-cache one
    started with prefix caching off), which the benchmark stops when the mode is done."""
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--compare-no-cache", "--kv-cache-memory", "18MiB", "--workload", "few-shot",
                   "--num-requests", "3", "--concurrency", "1", "--prefix-len", "64", "--suffix-len", "8:16",
                   "--output-len", "3", "--warmup", "1", "--json", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    document = json.loads(out.read_text())
    assert document["config"]["target"] == "local" and document["config"]["modes"] == ["cache", "no_cache"]
    report = document["workloads"]["few-shot"]
    # The owned platform's cache is reset after the warm-up, so only the first request misses.
    assert report["cache"]["cached_tokens"] == 2 * 64 and report["cache"]["miss_reasons"]["cold"] == 1
    assert report["no_cache"]["cached_tokens"] == 0 and report["no_cache"]["miss_reasons"] == {"disabled": 3}


def _processes_writing_under(directory: Path) -> list[int]:
    """Processes holding a file open below `directory` (the services keep their log open as stdout)."""
    found = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd).startswith(f"{directory}/"):
                found.add(int(fd.parent.parent.name))
        except OSError:  # gone while listing, or not ours to read
            continue
    return sorted(found)


def _bench_process(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`prefixcache bench` in its own process, its local platform's log folder under `tmp_path`."""
    return subprocess.Popen([sys.executable, "-m", "prefixcache.cli.main", "bench", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})


def test_sigterm_stops_the_local_platform_the_bench_started(tmp_path):
    bench = _bench_process(tmp_path, "--workload", "unique", "--num-requests", "200", "--concurrency", "1",
                           "--kv-cache-memory", "18MiB", "--prefix-len", "64", "--suffix-len", "8:16",
                           "--output-len", "3", "--warmup", "0", "--no-progress")
    try:
        deadline = time.monotonic() + 240
        while not any("engine ready" in log.read_text() for log in tmp_path.glob("prefixcache-bench-*/scheduler.log")):
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.5)
        assert len(_processes_writing_under(tmp_path)) == 3  # the services
        time.sleep(2)  # requests are running
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert _processes_writing_under(tmp_path) == []  # every service stopped
    assert list(tmp_path.glob("prefixcache-bench-*")) == []  # and its logs removed


def test_a_local_platform_that_does_not_start_keeps_its_logs_and_says_why(tmp_path):
    bench = _bench_process(tmp_path, "--workload", "unique", "--num-requests", "1", "--kv-cache-memory", "18MiB",
                           "--scheduler-arg=--max-num-seqs=0", "--no-progress")
    _, err = bench.communicate(timeout=300)
    assert bench.returncode == 2, err
    assert "the local platform did not start: the scheduler exited with status 2" in err
    assert "max_num_seqs must be positive, got 0" in err  # the end of its log
    [log_dir] = tmp_path.glob("prefixcache-bench-*")
    assert f"(logs kept in {log_dir})" in err and (log_dir / "scheduler.log").is_file()
    assert _processes_writing_under(tmp_path) == []
