"""The cache's observability against real processes: `prefixcache events` tails the KV events stream,
`prefixcache diagnose` predicts from a thrashing run what twice the KV memory would hit (and a second
run with twice the memory measures it), and all three services serve /metrics."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from platform_harness import restart_worker, run, scrape_metrics, start_platform, stop_platform, wait_idle
from platform_prompts import shared_prefix

from prefixcache.bench.workloads import IntRange, WorkloadOptions, thrash
from prefixcache.client import EngineClient, build_request
from prefixcache.launcher import LocalPlatform, free_port

pytestmark = pytest.mark.slow

# KV bytes one block of 16 tokens takes with the embedded model in float32 (30 layers, 3 KV heads of 64).
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * 16
BLOCKS = 40
# Eight 6-block prefixes, each visited three times in turn with a fresh suffix: about 60 blocks in a
# cycle, so 40 blocks miss every revisit (LRU's worst case) and 80 blocks hold them all.
THRASH = WorkloadOptions(thrash_prefixes=8, prefix_len=6 * 16, suffix_len=IntRange(2, 40), output_len=2, seed=3)


def prefixcache(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixcache.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    platform = start_platform(tmp_path_factory.mktemp("small-cache-logs"), kv_cache_memory=str(BLOCKS * BLOCK_BYTES),
                              worker_args=["--metrics-port", str(free_port())],
                              tokenizer_args=["--metrics-port", str(free_port())])
    yield platform
    stop_platform(platform)


def run_thrash(target: str) -> float:
    """The thrash workload, one request at a time; its measured prompt-token hit rate."""
    async def main() -> float:
        prompt = cached = 0
        async with EngineClient(target) as engine:
            for request in thrash(THRASH):
                completion = await engine.complete(build_request(token_ids=request.prompt_token_ids, max_tokens=2),
                                                   timeout_s=300)
                prompt += completion.usage.prompt_tokens
                cached += completion.usage.cached_tokens
        return cached / prompt

    return run(main())


def test_diagnose_predicts_what_twice_the_memory_measures(small_cache: LocalPlatform, tmp_path: Path) -> None:
    target = small_cache.engine_address
    stats = run(wait_idle(target))
    assert stats.num_blocks == BLOCKS
    small_rate = run_thrash(target)
    report, plot = tmp_path / "diagnosis.json", tmp_path / "curve.png"
    result = prefixcache("diagnose", "--target", target, "--window", str(THRASH.num_thrash_requests),
                         "--json", str(report), "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    diagnosis = json.loads(report.read_text())
    assert result.stdout.strip().splitlines()[-1] == f"verdict: {diagnosis['verdict']}"
    assert diagnosis["lookups"] == THRASH.num_thrash_requests and diagnosis["hit_rate"] == pytest.approx(small_rate)
    assert diagnosis["verdict"].startswith("thrashing: raise the KV budget to ")
    assert diagnosis["evicted_miss_share"] > 0.5 and diagnosis["miss_tokens"]["evicted"] > 0
    assert [p["count"] for p in diagnosis["top_evicted_prefixes"]] == [2] * THRASH.thrash_prefixes
    predicted = {w["memory_factor"]: w["hit_rate"] for w in diagnosis["what_if"]}
    assert {0.5, 1.5, 2.0, 4.0} <= predicted.keys() and plot.stat().st_size > 10_000

    # The same workload with twice the memory: the worker restarts with it, the scheduler takes the new pool.
    argv = small_cache.worker.argv
    argv[argv.index("--kv-cache-memory") + 1] = str(2 * BLOCKS * BLOCK_BYTES)
    restart_worker(small_cache)
    run(small_cache.wait_serving(small_cache.worker, 240))
    double_rate = run_thrash(target)
    assert run(wait_idle(target)).num_blocks == 2 * BLOCKS
    assert small_rate < 0.05 and double_rate > 0.4
    assert abs(predicted[2.0] - double_rate) <= 0.05, (predicted, small_rate, double_rate)


def test_bad_input_is_refused_naming_the_field(target: str) -> None:
    async def main() -> None:
        async with EngineClient(target) as engine:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await engine.diagnose(window=-1)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("window: ")

    run(main())
    result = prefixcache("events", "--target", target, "--from", str(2**62))
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: INVALID_ARGUMENT: from_seq: {2**62} is beyond the next batch")
    assert prefixcache("diagnose", "--target", target, "--window", "-1").returncode == 2  # refused before any call


def test_events_tails_the_kv_events_stream_as_json_lines(target: str) -> None:
    """From a snapshot's sequence number on, the lines the command prints rebuild the next snapshot."""
    async def snapshot():
        async with EngineClient(target) as engine:
            return await engine.cached_blocks()

    before = run(snapshot())
    tail = subprocess.Popen([sys.executable, "-m", "prefixcache.cli.main", "events", "--target", target,
                             "--from", str(before.seq + 1), "--json"], stdout=subprocess.PIPE, text=True)
    try:
        async def requests() -> None:
            async with EngineClient(target) as engine:
                for n in range(3):
                    prompt = shared_prefix(5 * 16, f"tailed {time.monotonic_ns()} {n}")
                    await engine.complete(build_request(token_ids=prompt, max_tokens=2), timeout_s=120)

        run(requests())
        after = run(snapshot())
        held = set(before.block_hashes)
        seq = before.seq
        while seq < after.seq:
            line = json.loads(tail.stdout.readline())
            assert line["type"] == "batch" and line["seq"] == seq + 1
            seq = line["seq"]
            for event in line["events"]:
                if event["type"] == "stored":
                    assert event["block_size"] == 16 and event["token_count"] == 16 * len(event["block_hashes"])
                    held |= {bytes.fromhex(h) for h in event["block_hashes"]}
                elif event["type"] == "removed":
                    held -= {bytes.fromhex(h) for h in event["block_hashes"]}
                else:
                    held.clear()
        assert held == set(after.block_hashes) and seq == after.seq
    finally:
        tail.send_signal(signal.SIGINT)
        assert tail.wait(30) == 128 + signal.SIGINT


def test_every_service_serves_metrics_with_the_model_name(small_cache: LocalPlatform) -> None:
    async def one() -> None:
        async with EngineClient(small_cache.engine_address) as engine:
            await engine.complete(build_request(token_ids=shared_prefix(40, f"scraped {time.monotonic_ns()}"),
                                                max_tokens=3), timeout_s=120)

    run(one())
    run(wait_idle(small_cache.engine_address))
    scheduler = scrape_metrics(small_cache)
    for name in ("prefixcache_time_to_first_token_seconds_count{prefix_cache_hit=\"false\"}",
                 "prefixcache_inter_token_latency_seconds_count", "prefixcache_e2e_request_latency_seconds_count",
                 "prefixcache_request_queue_time_seconds_count", "prefixcache_request_prefill_time_seconds_count",
                 "prefixcache_prefix_cache_missed_tokens_total{reason=\"evicted\"}",
                 "prefixcache_prefix_cache_evictions_total", "prefixcache_kv_cache_usage_perc",
                 "prefixcache_kv_cached_idle_blocks", "prefixcache_kv_events_dropped_total",
                 "prefixcache_prefix_cache_ghost_hits_total"):
        assert name in scheduler, name
    worker = scrape_metrics(small_cache, "worker")
    assert worker['prefixcache_rpc_server_handled_total{code="OK",method="prefixcache.worker.v1.Worker/ExecuteStep"}'] > 0
    assert "process_resident_memory_bytes" in worker
    tokenizer = scrape_metrics(small_cache, "tokenizer")
    assert any(name.startswith("prefixcache_rpc_server_handling_seconds_count") and "Detokenize" in name
               for name in tokenizer)
