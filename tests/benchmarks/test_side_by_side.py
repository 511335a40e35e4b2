"""`benchmarks/side_by_side.py`: the interleaved runs of the comparisons against other systems, and
their table. The systems here are in-process Engines on real loopback gRPC that note when each
request starts, which no real engine can show."""
import asyncio
import threading
import time

import pytest
from engine_stub_server import serving
from side_by_side import ComparedSystem, render_systems, run_interleaved

from prefixcache.bench.engine import EngineEndpoint
from prefixcache.bench.metrics import RequestRecord, summarize
from prefixcache.bench.workloads import IntRange, WorkloadOptions, generate
from prefixcache.protos.engine.v1 import engine_pb2, engine_pb2_grpc

OPTIONS = WorkloadOptions(num_requests=3, prefix_len=64, suffix_len=IntRange(4, 30), output_len=4, vocab_size=1000)


class TimelineEngine(engine_pb2_grpc.EngineServicer):
    """Notes each request it starts on a timeline shared with other engines, and the most requests it
    ran at once; streams `max_tokens` tokens in one message."""

    def __init__(self, name: str, timeline: list[tuple[str, str]], refuse_reset: bool = False):
        self.name, self.timeline, self.refuse_reset = name, timeline, refuse_reset
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.timeline.append((self.name, request.request_id.split("-", 2)[2]))  # past the per-run prefix
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.01)
        with self.lock:
            self.in_flight -= 1
        n = request.sampling.max_tokens
        yield engine_pb2.GenerateResponse(
            request_id=request.request_id, token_ids=[5] * n, finish_reason=engine_pb2.FINISH_REASON_LENGTH,
            usage=engine_pb2.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n))

    def GetCacheStats(self, request, context):
        return engine_pb2.CacheStats()

    def ResetPrefixCache(self, request, context):
        return engine_pb2.ResetPrefixCacheResponse(reset=not self.refuse_reset)


def test_interleaved_systems_take_turns_going_first():
    """Each workload runs through every system before the next one starts, the system that goes first
    rotating; each system keeps its own concurrency; an owned engine is reset before each workload,
    and a refusal is noted."""
    timeline: list[tuple[str, str]] = []
    first_engine = TimelineEngine("first", timeline, refuse_reset=True)
    second_engine = TimelineEngine("second", timeline)
    workloads = ("unique", "few-shot", "shared-system-prompt")
    requests = {name: generate(name, OPTIONS) for name in workloads}
    notes: list[str] = []

    async def main(first_target: str, second_target: str) -> dict:
        async with EngineEndpoint(first_target) as first, EngineEndpoint(second_target) as second:
            systems = [ComparedSystem("first", first, concurrency=3, owned_engine=first),
                       ComparedSystem("second", second, concurrency=1)]
            return await run_interleaved(requests, systems, tenants=1, note=notes.append)

    with serving(first_engine) as first_target, serving(second_engine) as second_target:
        summaries = asyncio.run(main(first_target, second_target))
    runs = [(system, request_id.rsplit("-", 1)[0]) for system, request_id in timeline]
    assert [runs[i] for i in range(0, len(runs), 3)] == [
        ("first", "unique"), ("second", "unique"), ("second", "few-shot"), ("first", "few-shot"),
        ("first", "shared-system-prompt"), ("second", "shared-system-prompt")]
    assert all(runs[i] == runs[i - i % 3] for i in range(len(runs)))  # one system and workload at a time
    assert all(summaries[system][name].completed == 3 for system in ("first", "second") for name in workloads)
    assert first_engine.most_in_flight == 3 and second_engine.most_in_flight == 1
    assert notes == [f"first refused to reset its prefix cache before {name}" for name in workloads]


def run(ttft, finished, cached, reason):
    return summarize([RequestRecord("r", 0.0, [(ttft, 1), (finished, 1)], finished, 1000, cached, 2, reason, "")],
                     evictions=0)


def test_systems_table_divides_by_the_baseline():
    fast, slow = run(0.1, 0.5, 992, "cold"), run(0.8, 2.0, 0, "disabled")
    text = render_systems({"vllm": {"few-shot": slow}, "prefixcache": {"few-shot": fast}}, baseline="vllm")
    assert text.splitlines()[0].split() == ["few-shot", "vllm", "prefixcache", "prefixcache", "/", "vllm"]
    rows = {line.strip().split("  ")[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    assert rows["output tokens/s"][-3:] == ["1.0", "4.0", "4.00x"]
    assert rows["TTFT p50 (ms)"][-3:] == ["800.0", "100.0", "0.12x"]
    with pytest.raises(ValueError, match="baseline"):
        render_systems({"vllm": {}}, baseline="sglang")


def test_a_workload_a_system_did_not_run_has_no_column_for_it():
    fast = run(0.1, 0.5, 992, "cold")
    text = render_systems({"vllm": {"unique": fast}, "prefixcache": {"unique": fast, "few-shot": fast}},
                          baseline="vllm")
    blocks = text.split("\n\n")
    assert blocks[1].splitlines()[0].split() == ["few-shot", "prefixcache"]  # no baseline there: no ratio column
