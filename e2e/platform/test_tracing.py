"""Trace context crosses every service; the request span carries usage and cache attributes, never
the prompt text or the cache salt. The services export spans to their logs (console exporter)."""
from __future__ import annotations

import json
import time

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from platform_harness import run
from platform_prompts import shared_prefix
from span_logs import eventually, is_request_span, spans_in, spans_of_trace

from prefixcache.client import EngineClient, build_request
from prefixcache.launcher import LocalPlatform

pytestmark = pytest.mark.slow

TRACE_ID = 0x5EED0000000000000000000000C0FFEE
CALLER_SPAN_ID = 0x00000000DEADBEEF
SECRET_PROMPT = "Zanzibar quokka parliament, please summarise."
SECRET_SALT = "salt-that-must-never-be-logged-4f1c"


def test_trace_context_crosses_all_services(platform: LocalPlatform, target: str) -> None:
    caller = SpanContext(TRACE_ID, CALLER_SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    async def main():
        async with EngineClient(target) as engine:
            with trace.use_span(NonRecordingSpan(caller)):  # the client interceptor injects traceparent
                request = build_request(text=SECRET_PROMPT, max_tokens=4, temperature=0.0, cache_salt=SECRET_SALT)
                return await engine.complete(request, timeout_s=120)

    completion = run(main())
    logs = {service.name: service.log_path for service in platform.services}
    eventually(lambda: any(is_request_span(s) for s in spans_of_trace(logs["scheduler"], TRACE_ID)),
               "the scheduler exported no request span")

    scheduler_spans = spans_of_trace(logs["scheduler"], TRACE_ID)
    server_span = next(s for s in scheduler_spans if s["name"] == "prefixcache.engine.v1.Engine/Generate")
    assert server_span["parent_id"] == f"0x{CALLER_SPAN_ID:016x}"
    assert server_span["attributes"]["rpc.grpc.status_code"] == 0
    request_span = next(s for s in scheduler_spans if is_request_span(s))
    assert request_span["name"] == f"text_completion {request_span['attributes']['gen_ai.request.model']}"
    attributes = request_span["attributes"]
    assert attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens == 4
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == completion.usage.cached_tokens
    assert attributes["gen_ai.request.model"].startswith("SmolLM2-135M-Instruct@")
    assert attributes["gen_ai.provider.name"] == "prefixcache"
    assert attributes["prefix_cache.block_size"] == 16 and attributes["prefix_cache.hash_algo"] == "sha256"
    assert attributes["prefix_cache.blocks_queried"] == completion.cache_account.queried_blocks
    assert attributes["prefix_cache.miss_reason"] == completion.cache_account.miss_reason

    # The tokenizer's server spans (Tokenize, DetokenizeStream) belong to the caller's trace (its
    # exporter runs on its own schedule, so they may land a moment later).
    tokenizer_spans = {"prefixcache.tokenizer.v1.Tokenizer/Tokenize", "prefixcache.tokenizer.v1.Tokenizer/DetokenizeStream"}
    eventually(lambda: tokenizer_spans <= {s["name"] for s in spans_of_trace(logs["tokenizer"], TRACE_ID)},
               "the tokenizer's spans are missing from the caller's trace")

    # Engine steps serve batches: each step span links to the request spans it served, and the
    # worker's ExecuteStep span is the step span's child.
    request_span_id = request_span["context"]["span_id"]
    steps = [
        s for s in spans_in(logs["scheduler"])
        if s["name"] == "execute_step" and any(link["context"]["span_id"] == request_span_id for link in s["links"])
    ]  # fmt: skip
    assert len(steps) >= 4  # a prefill and three decodes at least
    eventually(lambda: {s["context"]["span_id"] for s in steps} <= {
        s["parent_id"] for s in spans_in(logs["worker"]) if s["name"].endswith("Worker/ExecuteStep")
    }, "a step span has no ExecuteStep child in the worker")

    for log in logs.values():
        text = log.read_text(errors="replace")
        assert SECRET_PROMPT not in text and "Zanzibar" not in text
        assert SECRET_SALT not in text


def test_a_cache_hit_is_on_the_request_span(platform: LocalPlatform, target: str) -> None:
    trace_id = 0x5EED000000000000000000000000C1D7
    caller = SpanContext(trace_id, CALLER_SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    prefix = shared_prefix(20 * 16, f"a traced hit {time.monotonic_ns()}")

    async def main():
        async with EngineClient(target) as engine:
            await engine.complete(build_request(token_ids=prefix + [13], max_tokens=1, temperature=0.0), timeout_s=120)
            with trace.use_span(NonRecordingSpan(caller)):
                request = build_request(token_ids=prefix + [13, 13], max_tokens=2, temperature=0.0)
                return await engine.complete(request, timeout_s=120)

    completion = run(main())
    assert completion.usage.cached_tokens == 20 * 16
    log = platform.scheduler.log_path
    eventually(lambda: any(is_request_span(s) for s in spans_of_trace(log, trace_id)),
               "the scheduler exported no request span")
    attributes = next(s for s in spans_of_trace(log, trace_id) if is_request_span(s))["attributes"]
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 20 * 16
    assert attributes["prefix_cache.blocks_queried"] == completion.cache_account.queried_blocks == 20
    assert attributes["prefix_cache.blocks_matched"] == completion.cache_account.hit_blocks == 20
    assert attributes["prefix_cache.miss_reason"] == completion.cache_account.miss_reason


def test_evictions_are_span_events_naming_block_hashes_and_the_requests_that_stored_them(
        platform: LocalPlatform, target: str) -> None:
    prompt_blocks = 63
    run_id = time.monotonic_ns()

    async def main() -> tuple[int, int, list[str]]:
        async with EngineClient(target) as engine:
            assert await engine.reset_prefix_cache()  # only this test's requests hold cached blocks
            before = await engine.cache_stats()
            # Distinct prompts until their blocks outnumber the pool: the last ones must evict.
            request_ids = [f"district-{run_id}-{n}" for n in range(before.num_blocks // prompt_blocks + 1)]
            for n, request_id in enumerate(request_ids):
                prompt = shared_prefix(prompt_blocks * 16, f"district {n}")
                await engine.complete(build_request(token_ids=prompt, max_tokens=1, temperature=0.0,
                                                    request_id=request_id), timeout_s=300)
            after = await engine.cache_stats()
            return before.evictions, after.evictions, request_ids

    def eviction_events() -> list[dict]:
        return [
            event
            for span in spans_in(platform.scheduler.log_path)
            if is_request_span(span) and span["attributes"]["gen_ai.request.id"] in request_ids
            for event in span["events"]
            if event["name"] == "prefix_cache.eviction"
        ]

    before, after, request_ids = run(main())
    assert after > before
    evicted = lambda: sum(e["attributes"]["prefix_cache.evicted_blocks"] for e in eviction_events())  # noqa: E731
    eventually(lambda: evicted() == after - before, "the eviction events do not add up to the evictions")
    events = eviction_events()
    hashes = [h for e in events for h in e["attributes"]["prefix_cache.block_hashes"]]
    assert len(hashes) == after - before  # each batch is far below the per-event cap
    assert all(len(bytes.fromhex(h)) == 32 for h in hashes)  # sha256
    storers = {r for e in events for r in e["attributes"]["prefix_cache.storing_request_ids"]}
    assert storers and storers <= set(request_ids[:-1])  # earlier requests of this test filled them


def test_a_cancelled_request_span_reports_what_it_delivered(platform: LocalPlatform, target: str) -> None:
    trace_id = 0x5EED00000000000000000000000CA5E1
    caller = SpanContext(trace_id, CALLER_SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    async def main() -> int:
        async with EngineClient(target) as engine:
            with trace.use_span(NonRecordingSpan(caller)):
                call = engine.generate(build_request(text="Count to one hundred:", max_tokens=200, temperature=0.0,
                                                     ignore_eos=True))
                delivered = 0
                while delivered < 3:
                    delivered += len((await call.read()).token_ids)
                call.cancel()
                return delivered

    delivered = run(main())
    log = platform.scheduler.log_path
    eventually(lambda: any(is_request_span(s) for s in spans_of_trace(log, trace_id)),
               "the scheduler exported no span for the cancelled request")
    attributes = next(s for s in spans_of_trace(log, trace_id) if is_request_span(s))["attributes"]
    assert attributes["gen_ai.response.finish_reasons"] == ["abort"]
    # At least what the client read; the server may have sent a few more before it saw the cancel.
    assert delivered <= attributes["gen_ai.usage.output_tokens"] < 200


def test_a_request_cancelled_before_its_first_token_still_reports_its_cache_lookup(
        platform: LocalPlatform, target: str) -> None:
    trace_id = 0x5EED0000000000000000000000EA2717
    caller = SpanContext(trace_id, CALLER_SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    prompt = shared_prefix(64 * 16, f"a cold survey {time.monotonic_ns()}")  # a second of prefill at least

    async def main() -> None:
        async with EngineClient(target) as engine:
            with trace.use_span(NonRecordingSpan(caller)):
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await engine.complete(build_request(token_ids=prompt, max_tokens=4), timeout_s=0.3)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    run(main())
    log = platform.scheduler.log_path
    eventually(lambda: any(is_request_span(s) for s in spans_of_trace(log, trace_id)),
               "the scheduler exported no span for the cancelled request")
    attributes = next(s for s in spans_of_trace(log, trace_id) if is_request_span(s))["attributes"]
    assert attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert attributes["gen_ai.usage.output_tokens"] == 0
    assert attributes["prefix_cache.miss_reason"] == "cold"
    assert attributes["prefix_cache.blocks_queried"] == 64
    eventually(lambda: any(s["name"].endswith("Engine/Generate") for s in spans_of_trace(log, trace_id)),
               "the scheduler exported no server span for the call")
    server = next(s for s in spans_of_trace(log, trace_id) if s["name"].endswith("Engine/Generate"))
    assert server["attributes"]["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert server["status"]["status_code"] == "ERROR"  # a server span's error, by OpenTelemetry's gRPC conventions


def test_health_checks_make_no_spans(platform: LocalPlatform) -> None:
    """Probes run every few seconds in a cluster: spans of them would bury the requests'."""
    for log in (service.log_path for service in platform.services):
        assert not [s for s in spans_in(log) if "grpc.health" in s["name"] or "reflection" in s["name"]]


def test_a_refused_request_span_names_the_failure_without_quoting_the_request(platform: LocalPlatform,
                                                                               target: str) -> None:
    trace_id = 0x5EED000000000000000000000000BAD1
    caller = SpanContext(trace_id, CALLER_SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    async def main() -> None:
        async with EngineClient(target) as engine:
            with trace.use_span(NonRecordingSpan(caller)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await engine.complete(build_request(messages=[("Zanzibar-wizard", SECRET_PROMPT)], max_tokens=2))
        assert "Zanzibar-wizard" in refused.value.details()  # the client is told what was wrong

    run(main())
    logs = [service.log_path for service in platform.services]
    eventually(lambda: any(is_request_span(s) for s in spans_of_trace(platform.scheduler.log_path, trace_id)),
               "the scheduler exported no span for the refused request")
    spans = [span for log in logs for span in spans_of_trace(log, trace_id)]
    generate = next(s for s in spans if is_request_span(s))
    assert generate["status"]["status_code"] == "ERROR"
    tokenize = next(s for s in spans if s["name"] == "prefixcache.tokenizer.v1.Tokenizer/Tokenize")
    assert tokenize["attributes"]["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    server = next(s for s in spans if s["name"] == "prefixcache.engine.v1.Engine/Generate")
    assert server["attributes"]["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert server["status"]["status_code"] == "UNSET"  # the caller's mistake, not the server's fault
    assert not any(event["name"] == "exception" for span in spans for event in span["events"])
    assert "Zanzibar" not in json.dumps(spans)  # neither the role nor the text, in any span
