"""The driver's own guarantees, observed from the server side of a real gRPC loopback connection.

A real engine cannot show how many streams a client keeps open or in which order a conversation's
turns arrive, so this in-process Engine records both; the e2e test runs against the real platform.
"""
import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import grpc
import pytest
from engine_stub_server import serving

from prefixcache.bench.driver import TenantSalts, drive
from prefixcache.bench.engine import EngineEndpoint
from prefixcache.bench.metrics import summarize
from prefixcache.bench.session import BenchConfig, BenchOutcome, run_session
from prefixcache.bench.workloads import IntRange, WorkloadOptions, generate
from prefixcache.cli import main as cli
from prefixcache.protos.engine.v1 import engine_pb2, engine_pb2_grpc

BLOCK = 16


class RecordingEngine(engine_pb2_grpc.EngineServicer):
    """Streams `max_tokens` tokens in two messages; 'caches' full prompt blocks per salt."""

    def __init__(self):
        self.in_flight = self.most_in_flight = 0
        self.started, self.finished, self.salts = [], [], []
        self.cached_blocks = set()
        self.evictions = 0
        self.refuse_reset = False  # as an engine does while other requests hold blocks
        self.lock = threading.Lock()

    def Generate(self, request, context):
        assert request.request_id.startswith("bench-")  # a per-run prefix keeps concurrent runs apart
        request_id = request.request_id.split("-", 2)[2]
        if request_id.endswith("-bad"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: out of vocabulary")
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.started.append(request_id)
            self.salts.append(request.cache_salt)
        ids = list(request.token_ids.ids)
        keys = [(request.cache_salt, tuple(ids[: (i + 1) * BLOCK])) for i in range(len(ids) // BLOCK)]
        hit = 0
        while hit < len(keys) and keys[hit] in self.cached_blocks and (hit + 1) * BLOCK < len(ids):
            hit += 1
        time.sleep(0.01)
        n = request.sampling.max_tokens
        yield engine_pb2.GenerateResponse(request_id=request.request_id, token_ids=[5] * (n // 2),
                                          cache_account=engine_pb2.CacheAccount(miss_reason="full_hit" if hit else "cold"))
        time.sleep(0.01)
        with self.lock:
            self.cached_blocks.update(keys)
            self.evictions += 1
            self.in_flight -= 1
            self.finished.append(request_id)
        yield engine_pb2.GenerateResponse(
            request_id=request.request_id, token_ids=[6] * (n - n // 2), finish_reason=engine_pb2.FINISH_REASON_LENGTH,
            usage=engine_pb2.Usage(prompt_tokens=len(ids), cached_tokens=hit * BLOCK, completion_tokens=n),
            cache_account=engine_pb2.CacheAccount(miss_reason="full_hit" if hit else "cold"))

    def GetCacheStats(self, request, context):
        return engine_pb2.CacheStats(block_size=BLOCK, evictions=self.evictions, prefix_caching_enabled=True)

    def ResetPrefixCache(self, request, context):
        if self.refuse_reset:
            return engine_pb2.ResetPrefixCacheResponse(reset=False)
        self.cached_blocks.clear()
        return engine_pb2.ResetPrefixCacheResponse(reset=True)

    def Describe(self, request, context):
        return engine_pb2.EngineDescription(model_id="recording", vocab_size=1000, max_model_len=4096,
                                            block_size=BLOCK, num_kv_blocks=40, prefix_caching_enabled=True)


@pytest.fixture
def engine_server():
    """(servicer, target) of a RecordingEngine on loopback."""
    servicer = RecordingEngine()
    with serving(servicer) as target:
        yield servicer, target


OPTIONS = WorkloadOptions(num_requests=24, prefix_len=64, suffix_len=IntRange(4, 30), output_len=4,
                          vocab_size=1000, turns=IntRange(3, 5))


async def _drive(target, requests, concurrency, tenants=1):
    async with EngineEndpoint(target) as endpoint:
        return await drive(endpoint, requests, concurrency, TenantSalts(tenants))


def test_concurrency_bound_and_usage_are_recorded(engine_server):
    servicer, target = engine_server
    requests = generate("shared-system-prompt", OPTIONS)
    result = asyncio.run(_drive(target, requests, concurrency=3))
    assert servicer.most_in_flight == 3
    assert [r.request_id for r in result.records] == [r.request_id for r in requests]
    assert all(r.ok and r.completion_tokens == 4 and len(r.chunks) == 2 for r in result.records)
    assert result.evictions == 24  # the counter moved once per request between the two GetCacheStats
    assert sum(r.cached_tokens for r in result.records) > 0
    assert {r.miss_reason for r in result.records} == {"cold", "full_hit"}


def test_conversation_turns_wait_for_their_predecessor(engine_server):
    servicer, target = engine_server
    requests = generate("multi-turn", OPTIONS)
    asyncio.run(_drive(target, requests, concurrency=8))
    for request in requests:
        if request.after:
            assert servicer.finished.index(request.after) < servicer.started.index(request.request_id)
    assert servicer.most_in_flight > 1  # different conversations overlap


def test_tenants_get_distinct_secret_salts(engine_server):
    servicer, target = engine_server
    requests = generate("shared-system-prompt", replace(OPTIONS, tenants=3))
    result = asyncio.run(_drive(target, requests, concurrency=1, tenants=3))
    assert len(set(servicer.salts)) == 3 and all(len(s) >= 43 for s in servicer.salts)
    # Three tenants: the first request of each misses the shared prompt, the rest hit it.
    assert [r.cached_tokens > 0 for r in result.records].count(False) == 3
    assert "TenantSalts(3 tenants)" == repr(TenantSalts(3))


def test_a_refused_cache_reset_is_reported(engine_server):
    servicer, target = engine_server
    config = BenchConfig(workloads=("unique", "few-shot"), options=replace(OPTIONS, num_requests=2), target=target,
                         reset_between_workloads=True, warmup_requests=0, show_progress=False)
    notes = []
    asyncio.run(run_session(config, note=notes.append))
    assert notes == []
    servicer.refuse_reset = True
    asyncio.run(run_session(config, note=notes.append))
    assert [note.split(":")[1].split("(")[0].strip() for note in notes] == ["unique", "few-shot"]
    assert all("refused to reset its prefix cache" in note for note in notes)


def test_poisson_arrivals_are_respected(engine_server):
    _, target = engine_server
    requests = generate("unique", replace(OPTIONS, num_requests=6, request_rate=20.0))
    result = asyncio.run(_drive(target, requests, concurrency=6))
    for request, record in zip(requests, result.records):
        assert record.sent_s >= request.arrival_s - 1e-3


def test_failed_requests_are_reported_not_raised(engine_server):
    _, target = engine_server
    requests = generate("unique", replace(OPTIONS, num_requests=2))
    requests[1] = replace(requests[1], request_id="unique-bad")
    result = asyncio.run(_drive(target, requests, concurrency=2))
    assert result.records[0].ok
    assert result.records[1].error == "INVALID_ARGUMENT: token_ids: out of vocabulary"


def test_cli_against_a_target_writes_table_json_and_plot(engine_server, tmp_path, capsys):
    _, target = engine_server
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    rc = cli.main(["bench", "--target", target, "--workload", "shared-system-prompt,thrash", "--num-requests", "12",
                   "--prefix-len", "64", "--suffix-len", "4:20", "--output-len", "4", "--json", str(out),
                   "--plot", str(png), "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    table = captured.out
    assert "thrash sends 12 requests over 12 prefixes" in captured.err  # --num-requests applies to thrash too
    assert "serve with a smaller KV cache" in captured.err and "--kv-cache-memory" not in captured.err
    assert "shared-system-prompt" in table and "TTFT p50 (ms)" in table and "hit rate" in table
    report = json.loads(out.read_text())
    assert report["config"]["engine"]["model_id"] == "recording"
    # 40 blocks x 16 = 640 tokens = 10 prefixes, plus two (and at least the concurrency, 8)
    assert report["config"]["options"]["thrash_prefixes"] == 12
    mode = report["workloads"]["shared-system-prompt"]["cache"]
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(mode[key]) == {"p50", "p90", "p99"}
    assert mode["prompt_tokens"] > mode["cached_tokens"] > 0
    assert mode["hit_rate"] == pytest.approx(mode["cached_tokens"] / mode["prompt_tokens"])
    assert png.stat().st_size > 10_000


def test_cli_rejects_bad_input(engine_server, capsys):
    _, target = engine_server
    assert cli.main(["bench", "--target", target, "--concurrency", "0", "--no-progress"]) == 2
    assert "concurrency" in capsys.readouterr().err
    assert cli.main(["bench", "--target", target, "--compare-no-cache"]) == 2
    assert "--compare-no-cache with --target needs --no-cache-target" in capsys.readouterr().err
    assert cli.main(["bench", "--target", target, "--prefix-len", "5000", "--no-progress", "--warmup", "0"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run(engine_server, capsys, monkeypatch, tmp_path):
    servicer, target = engine_server
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    assert cli.main(["bench", "--target", target, "--plot", str(tmp_path / "p.png"), "--no-progress"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert servicer.started == []  # nothing was sent


def test_failed_requests_are_counted_by_status_and_the_first_one_is_shown(engine_server, tmp_path, capsys):
    _, target = engine_server
    out = tmp_path / "bench.json"
    # The engine takes 20 ms a request: a 1 ms deadline fails every one.
    rc = cli.main(["bench", "--target", target, "--workload", "unique", "--num-requests", "3", "--prefix-len", "64",
                   "--suffix-len", "4:20", "--output-len", "4", "--warmup", "0", "--request-timeout", "0.001",
                   "--json", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "3 requests failed; the first: DEADLINE_EXCEEDED" in captured.err
    assert "errors" in captured.out and "DEADLINE_EXCEEDED 3" in captured.out
    summary = json.loads(out.read_text())["workloads"]["unique"]["cache"]
    assert (summary["failed"], summary["errors"]) == (3, {"DEADLINE_EXCEEDED": 3})


def test_both_endpoints_are_checked_before_the_first_run(engine_server, capsys):
    servicer, target = engine_server  # an engine with caching on, given as the no-cache endpoint too
    rc = cli.main(["bench", "--target", target, "--compare-no-cache", "--no-cache-target", target,
                   "--workload", "unique", "--num-requests", "2", "--no-progress"])
    assert rc == 2
    assert f"the no_cache run needs an engine with prefix caching off, but {target} has it on" in capsys.readouterr().err
    assert servicer.started == []  # refused before the cache run (or its warm-up) sent anything


@pytest.mark.parametrize("args, message", [
    (["--target", ""], "expected HOST:PORT, got ''"),
    (["--target", "localhost:99999"], "the port must be in [1, 65535], got 99999"),
    (["--target", "localhost:5", "--no-cache-target", "localhost"], "expected HOST:PORT, got 'localhost'"),
])
def test_endpoints_must_be_host_and_port(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench", *args])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_local_platform_options_are_refused_with_a_target(engine_server, capsys):
    servicer, target = engine_server
    rc = cli.main(["bench", "--target", target, "--kv-cache-memory", "64MiB", "--startup-timeout", "5"])
    assert rc == 2
    assert "--kv-cache-memory, --startup-timeout configure the local platform, which --target replaces" \
        in capsys.readouterr().err
    assert servicer.started == []
    assert cli.main(["bench", "--target", target, "--dtype", "bfloat16"]) == 2
    assert "--dtype configures the local platform, which --target replaces" in capsys.readouterr().err


@pytest.mark.parametrize("ignored", [False, True], ids=["sigint", "sigint-ignored"])
def test_sigint_stops_a_run_unless_the_bench_was_started_with_it_ignored(engine_server, ignored):
    servicer, target = engine_server
    command = [sys.executable, "-m", "prefixcache.cli.main", "bench", "--target", target,
               "--workload", "unique", "--num-requests", "150", "--concurrency", "1", "--prefix-len", "64",
               "--suffix-len", "4:20", "--output-len", "4", "--warmup", "0", "--no-progress"]
    if ignored:  # as `cmd &` in a non-interactive shell starts it: SIGINT ignored, which the bench must keep
        # (a shell's trap, not a preexec_fn: Python code between fork and exec, in a process serving
        # gRPC on other threads, can abort the child)
        command = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *command]
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not servicer.started:  # requests are flowing (150 take about 3 s)
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.05)
        bench.send_signal(signal.SIGINT)
        out, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    if ignored:
        assert bench.returncode == 0 and len(servicer.finished) == 150, err
    else:
        assert bench.returncode == 130 and "stopped by SIGINT" in err and "Traceback" not in err, err
        assert len(servicer.finished) < 150


def test_an_outcome_is_complete_only_when_every_workload_ran_in_every_mode():
    outcome = BenchOutcome.for_workloads(["unique", "thrash"])
    summary = summarize([])
    outcome.results["unique"].summaries["cache"] = summary
    assert not outcome.complete(["cache"]) and list(outcome.finished_results) == ["unique"]
    outcome.results["thrash"].summaries["cache"] = summary
    assert outcome.complete(["cache"]) and not outcome.complete(["cache", "no_cache"])
