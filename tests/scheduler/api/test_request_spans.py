"""A request's span explains its cache lookup: who evicted the block it missed on (linked to that
request's span), what it evicted itself (linked to the requests that had stored it), its whole
account, a tenant label that is no salt, and children for its phases. In process, over real gRPC,
with an in-memory exporter."""
from __future__ import annotations

import asyncio

import pytest
from engine_harness import engine_api
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prefixcache.client import EngineClient, build_request
from prefixcache.rpc import tracing
from prefixcache.scheduler.api import servicer, spans
from prefixcache.scheduler.tenancy.salts import LABEL_HEX_CHARS
from prefixcache.tokenizer.text import TextTokenizer


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for module in (servicer, spans):
        monkeypatch.setattr(module, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_enabled", True)
    return exporter


def request_span(exporter: InMemorySpanExporter, request_id: str) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.attributes.get("gen_ai.request.id") == request_id]
    return span


def test_a_miss_names_its_evictor_and_links_both_ways(tokenizer: TextTokenizer, exporter: InMemorySpanExporter) -> None:
    prefix = list(range(300, 332))  # 8 blocks of 4

    async def main() -> None:
        async with engine_api(tokenizer, num_kv_blocks=12) as (target, _), EngineClient(target) as client:
            await client.complete(build_request(token_ids=prefix, max_tokens=2, request_id="keeper", tenant="acme"))
            await asyncio.sleep(0.01)
            await client.complete(build_request(token_ids=list(range(600, 640)), max_tokens=2, request_id="thief",
                                                tenant="acme"))
            await client.complete(build_request(token_ids=prefix + [9], max_tokens=3, request_id="victim",
                                                tenant="acme"))

    asyncio.run(asyncio.wait_for(main(), 60))
    keeper, thief, victim = (request_span(exporter, r) for r in ("keeper", "thief", "victim"))
    assert victim.name == "text_completion sim-model"

    attributes = victim.attributes
    assert attributes["prefix_cache.miss_reason"] == "evicted"
    assert attributes["prefix_cache.evicted_by"] == "thief"
    assert attributes["prefix_cache.evicted_block_stored_by"] == "keeper"
    assert attributes["prefix_cache.evicted_age_s"] > 0.01 and attributes["prefix_cache.evicted_ago_s"] > 0
    assert len(attributes["prefix_cache.first_missing_block"]) == 16
    assert (attributes["prefix_cache.queried_tokens"], attributes["prefix_cache.partial_tail_tokens"]) == (33, 1)
    assert attributes["gen_ai.usage.cache_read.input_tokens"] + attributes["prefix_cache.capped_tokens"] < 33
    assert attributes["gen_ai.server.time_to_first_token"] > 0
    (to_evictor,) = [link for link in victim.links if link.attributes["prefix_cache.link"] == "evicted_by"]
    assert to_evictor.context.span_id == thief.context.span_id

    events = [e for e in thief.events if e.name == "prefix_cache.eviction"]  # one per evicting allocation
    assert {r for e in events for r in e.attributes["prefix_cache.storing_request_ids"]} == {"keeper"}
    assert all(e.attributes["prefix_cache.oldest_evicted_age_s"] > 0.01 for e in events)
    (to_storer,) = [link for link in thief.links if link.attributes["prefix_cache.link"] == "evicted_blocks_of"]
    assert to_storer.context.span_id == keeper.context.span_id
    assert to_storer.attributes["prefix_cache.evicted_blocks"] == sum(e.attributes["prefix_cache.evicted_blocks"]
                                                                     for e in events)

    labels = {s.attributes["prefix_cache.tenant"] for s in (keeper, thief, victim)}
    assert len(labels) == 1 and len(next(iter(labels))) == LABEL_HEX_CHARS and "acme" not in next(iter(labels))
    assert victim.attributes["prefix_cache.isolation"] == "tenant"


def test_a_requests_phases_are_children_of_its_span(tokenizer: TextTokenizer, exporter: InMemorySpanExporter) -> None:
    async def main() -> None:
        async with engine_api(tokenizer) as (target, _), EngineClient(target) as client:
            # 100 tokens over a 64-token step budget: two prefill chunks.
            await client.complete(build_request(token_ids=list(range(400, 500)), max_tokens=5, request_id="phased"))

    asyncio.run(asyncio.wait_for(main(), 60))
    parent = request_span(exporter, "phased")
    children = sorted((s for s in exporter.get_finished_spans() if s.parent and s.parent.span_id == parent.context.span_id),
                      key=lambda s: s.start_time)
    assert [s.name for s in children] == ["queue", "prefix_cache.lookup", "prefill", "prefill", "decode"]
    assert [s.attributes["prefix_cache.step.num_tokens"] for s in children if s.name == "prefill"] == [64, 36]
    assert children[-1].attributes["prefix_cache.decode_steps"] == 4
    assert all(s.context.trace_id == parent.context.trace_id for s in children)
    queue, lookup, first_prefill = children[:3]
    assert queue.end_time <= lookup.start_time <= lookup.end_time <= first_prefill.start_time
    # Scheduled ahead, the first decode step may start while the last prefill step runs.
    assert first_prefill.end_time <= children[3].start_time <= children[4].start_time
    assert parent.start_time <= children[0].start_time and children[-1].end_time <= parent.end_time
