"""Against the three services as real processes, their spans printed to their logs: a request that
missed on an evicted block names its evictor on its own span and links to the evictor's span; the
evictor's span links to the request whose blocks it took; a request's trace shows its queueing,
lookup, prefill and decode, and from its prefill one link leads to the batched step span and, under
it, to the worker's ExecuteStep."""
from __future__ import annotations

import time

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from platform_harness import run
from platform_prompts import shared_prefix
from span_logs import eventually, is_request_span, spans_in, spans_of_trace

from prefixcache.client import EngineClient, build_request
from prefixcache.launcher import LocalPlatform

pytestmark = pytest.mark.slow


def request_span(platform: LocalPlatform, request_id: str) -> dict:
    def found() -> list[dict]:
        return [s for s in spans_in(platform.scheduler.log_path)
                if is_request_span(s) and s["attributes"]["gen_ai.request.id"] == request_id]
    eventually(lambda: found(), f"no span for {request_id}")
    (span,) = found()
    return span


def test_who_evicted_my_system_prompt(platform: LocalPlatform, target: str) -> None:
    """A 40-block system prompt, then a 100-block prompt that takes most of the 113-block pool (the
    system prompt's tail first: a request's blocks are released last block first), then the system
    prompt again: its lookup stops at an evicted block, and its span says who took it."""
    run_id = time.monotonic_ns()
    system = shared_prefix(40 * 16, f"the system prompt {run_id}")

    async def main() -> int:
        async with EngineClient(target) as engine:
            assert await engine.reset_prefix_cache()
            await engine.complete(build_request(token_ids=system + [13], max_tokens=1, request_id=f"first-{run_id}"),
                                  timeout_s=300)
            await engine.complete(build_request(token_ids=shared_prefix(100 * 16, f"another {run_id}"), max_tokens=1,
                                                request_id=f"thief-{run_id}"), timeout_s=300)
            again = await engine.complete(build_request(token_ids=system + [14], max_tokens=1,
                                                        request_id=f"again-{run_id}"), timeout_s=300)
            assert again.cache_account.miss_reason == "evicted" and 0 < again.cache_account.hit_blocks < 40
            return again.cache_account.hit_blocks

    hit_blocks = run(main())
    first, thief, again = (request_span(platform, f"{name}-{run_id}") for name in ("first", "thief", "again"))
    attributes = again["attributes"]
    assert attributes["prefix_cache.miss_reason"] == "evicted"
    assert attributes["prefix_cache.blocks_matched"] == hit_blocks
    assert attributes["prefix_cache.evicted_by"] == f"thief-{run_id}"
    assert attributes["prefix_cache.evicted_block_stored_by"] == f"first-{run_id}"
    assert 0 < attributes["prefix_cache.evicted_age_s"] < 300 and 0 <= attributes["prefix_cache.evicted_ago_s"] < 300
    assert len(attributes["prefix_cache.first_missing_block"]) == 16
    (to_thief,) = [link for link in again["links"] if link["attributes"]["prefix_cache.link"] == "evicted_by"]
    assert to_thief["context"]["span_id"] == thief["context"]["span_id"]
    assert to_thief["context"]["trace_id"] == thief["context"]["trace_id"]
    (to_first,) = [link for link in thief["links"] if link["attributes"]["prefix_cache.link"] == "evicted_blocks_of"]
    assert to_first["context"]["span_id"] == first["context"]["span_id"]
    evicted_hashes = {h[:16] for e in thief["events"] if e["name"] == "prefix_cache.eviction"
                      for h in e["attributes"]["prefix_cache.block_hashes"]}
    assert attributes["prefix_cache.first_missing_block"] in evicted_hashes  # found among the thief's events


def test_a_requests_trace_shows_its_phases_and_reaches_the_worker(platform: LocalPlatform, target: str) -> None:
    trace_id = 0x5EED0000000000000000000000F1A5E5
    caller = SpanContext(trace_id, 0x00000000DEADBEEF, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    prompt = shared_prefix(20 * 16, f"phases {time.monotonic_ns()}")

    async def main() -> None:
        async with EngineClient(target) as engine:
            with trace.use_span(NonRecordingSpan(caller)):
                await engine.complete(build_request(token_ids=prompt, max_tokens=4, temperature=0.0), timeout_s=120)

    run(main())
    log = platform.scheduler.log_path
    eventually(lambda: any(is_request_span(s) for s in spans_of_trace(log, trace_id)), "no request span")
    request = next(s for s in spans_of_trace(log, trace_id) if is_request_span(s))
    request_id = request["context"]["span_id"]
    eventually(lambda: {"queue", "prefix_cache.lookup", "prefill", "decode"} <= {
        s["name"] for s in spans_of_trace(log, trace_id) if s["parent_id"] == request_id}, "the phases are missing")
    assert request["attributes"]["gen_ai.server.time_to_first_token"] > 0
    (prefill,) = [s for s in spans_of_trace(log, trace_id) if s["parent_id"] == request_id and s["name"] == "prefill"]
    (to_step,) = prefill["links"]
    step_id = to_step["context"]["span_id"]
    steps = [s for s in spans_in(log) if s["name"] == "execute_step" and s["context"]["span_id"] == step_id]
    assert steps and any(link["context"]["span_id"] == request_id for link in steps[0]["links"])  # and back
    assert steps[0]["attributes"]["prefix_cache.step.id"] == prefill["attributes"]["prefix_cache.step.id"]
    eventually(lambda: any(s["parent_id"] == step_id and s["name"].endswith("Worker/ExecuteStep")
                           for s in spans_in(platform.worker.log_path)), "the worker's span is missing")
