"""What a request's span carries besides its outcome, following OpenTelemetry's GenAI conventions where
they name something: the request's gen_ai and prefix_cache attributes, its cache account and, for a
miss on an evicted block, who evicted it and when (with a link to the evictor's span); one event per
allocation of its own that evicted cached blocks (with links to the spans of the requests that had
stored them); and child spans for its phases, rebuilt from the engine's timeline once it ends: queue,
cache lookup, each prefill chunk and decode, the chunks linked to the batched step spans that computed
them (which link back). Hashes and ids only: never the prompt text, never the cache salt or tenant.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry import trace

from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.rpc.tracing import SpanRegistry
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.engine import WorkerInfo
from prefixcache.scheduler.kv_cache import CacheAccount, EvictionBatch, RequestRef
from prefixcache.scheduler.request import RequestTimeline

MAX_HASHES_PER_EVICTION_EVENT = 256
SHORT_HASH_HEX = 16  # a hash on a span attribute: 64 bits tell blocks apart and find them in events
LINK_KIND = "prefix_cache.link"  # why a link was made, on every link these spans carry
_tracer = trace.get_tracer(__name__)


def request_attributes(request_id: str, request: pb.GenerateRequest, config: SchedulerConfig,
                       info: WorkerInfo | None) -> dict[str, object]:
    attributes: dict[str, object] = {
        "gen_ai.provider.name": "prefixcache",  # OpenTelemetry's GenAI conventions require one
        "gen_ai.operation.name": "chat" if request.WhichOneof("prompt") == "chat" else "text_completion",
        "gen_ai.request.id": request_id,
        "prefix_cache.block_size": config.block_size,
        "prefix_cache.hash_algo": config.hash_algo,
        "prefix_cache.enabled": config.enable_prefix_caching,
    }
    if info is not None:
        attributes["gen_ai.request.model"] = info.model_id
    sampling = request.sampling
    if sampling.HasField("max_tokens"):
        attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.HasField("temperature"):
        attributes["gen_ai.request.temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        attributes["gen_ai.request.top_p"] = sampling.top_p
    return attributes


def request_span_name(attributes: dict[str, object]) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, as the GenAI conventions name inference spans."""
    model = attributes.get("gen_ai.request.model")
    return f"{attributes['gen_ai.operation.name']} {model}" if model else str(attributes["gen_ai.operation.name"])


def short_hash(block_hash: bytes) -> str:
    return block_hash.hex()[:SHORT_HASH_HEX]


def traced_context(span: trace.Span) -> trace.SpanContext | None:
    """What the cache remembers of a request's span, to link other spans to it (None when untraced)."""
    context = span.get_span_context()
    return context if context.is_valid else None


def _link(ref: RequestRef | None, kind: str, **attributes: object) -> trace.Link | None:
    context = ref.trace_context if ref is not None else None
    if not isinstance(context, trace.SpanContext) or not context.is_valid:
        return None
    return trace.Link(context, {LINK_KIND: kind, **attributes})


def account_attributes(account: CacheAccount, lookup_ns: int) -> dict[str, object]:
    """The whole cache account, and for a miss, the first block not found; for a miss on an evicted
    block, who evicted it, how long it had lived and how long before this lookup it went."""
    attributes: dict[str, object] = {
        "gen_ai.usage.cache_read.input_tokens": account.hit_tokens,
        "prefix_cache.queried_tokens": account.queried_tokens,
        "prefix_cache.capped_tokens": account.capped_tokens,
        "prefix_cache.partial_tail_tokens": account.partial_tail_tokens,
        "prefix_cache.blocks_queried": account.queried_blocks,
        "prefix_cache.blocks_matched": account.hit_blocks,
        "prefix_cache.miss_reason": account.miss_reason,
    }
    if account.first_missing_block is not None:
        attributes["prefix_cache.first_missing_block"] = short_hash(account.first_missing_block)
    eviction = account.eviction
    if eviction is not None:
        attributes["prefix_cache.evicted_by"] = eviction.evicted_by.request_id
        attributes["prefix_cache.evicted_age_s"] = eviction.age_ns / 1e9
        attributes["prefix_cache.evicted_ago_s"] = max(lookup_ns - eviction.evicted_at_ns, 0) / 1e9
        attributes["prefix_cache.evicted_block_stored_by"] = eviction.stored_by.request_id
    return attributes


def evictor_link(account: CacheAccount) -> trace.Link | None:
    """From a request that missed on an evicted block to the span of the request that evicted it."""
    if account.eviction is None:
        return None
    return _link(account.eviction.evicted_by, "evicted_by", **{
        "prefix_cache.block_hash": short_hash(account.first_missing_block or b"")})


def eviction_attributes(batch: EvictionBatch) -> dict[str, int | float | list[str]]:
    """One span event per allocation that evicted: how many blocks, which hashes (the first
    `MAX_HASHES_PER_EVICTION_EVENT`, LRU order), the requests whose tokens had filled those
    blocks (each once), and how long the oldest evicted block had lived. Both lists stay bounded: an
    allocation that evicts thousands of blocks stored by as many requests must not make a span too
    large to export."""
    listed = slice(MAX_HASHES_PER_EVICTION_EVENT)
    return {
        "prefix_cache.evicted_blocks": len(batch),
        "prefix_cache.block_hashes": [block_hash.hex() for block_hash in batch.block_hashes[listed]],
        "prefix_cache.storing_request_ids": list(dict.fromkeys(batch.storing_request_ids[listed])),
        "prefix_cache.oldest_evicted_age_s": batch.oldest_age_ns / 1e9,
    }


def storer_links(batches: Iterable[EvictionBatch]) -> list[trace.Link]:
    """From an evicting request to the span of each request whose blocks it evicted (the listed ones,
    each once), with how many of its blocks went."""
    storers: dict[str, RequestRef] = {}
    evicted: dict[str, int] = {}
    for batch in batches:
        for storer in batch.storers[:MAX_HASHES_PER_EVICTION_EVENT]:
            storers.setdefault(storer.request_id, storer)
            evicted[storer.request_id] = evicted.get(storer.request_id, 0) + 1
    links = (_link(storers[request_id], "evicted_blocks_of", **{"prefix_cache.evicted_blocks": count})
             for request_id, count in evicted.items())
    return [link for link in links if link is not None]


def add_phase_spans(parent: trace.Span, timeline: RequestTimeline, step_spans: SpanRegistry) -> None:
    """The request's phases as children of its span, with the times the engine recorded: `queue`
    (until the lookup that admitted it), `prefix_cache.lookup`, one `prefill` per step that computed
    its prompt (a recompute after a preemption too), each linked to that step's span, and `decode`
    (from the first decode step to the end), linked to its first and last steps' spans."""
    if not parent.is_recording():
        return
    context = trace.set_span_in_context(parent)
    now = time.time_ns()

    def child(name: str, start: int, end: int | None, attributes: dict[str, object] | None = None,
              step_ids: Iterable[int | None] = ()) -> None:
        links = [trace.Link(ctx, {LINK_KIND: "computed_in_step"}) for ctx in map(step_spans.step, step_ids) if ctx]
        span = _tracer.start_span(name, context=context, start_time=start, attributes=attributes, links=links)
        span.end(end_time=end or now)

    child("queue", timeline.queued_ns, timeline.lookup_ns)
    if timeline.lookup_ns is not None:
        child("prefix_cache.lookup", timeline.lookup_ns, timeline.admitted_ns)
    for work in timeline.prefill:
        child("prefill", work.scheduled_ns, work.done_ns,
              {"prefix_cache.step.id": work.step_id, "prefix_cache.step.num_tokens": work.num_tokens}, [work.step_id])
    if timeline.first_decode is not None:
        child("decode", timeline.first_decode.scheduled_ns, timeline.finished_ns,
              {"prefix_cache.decode_steps": timeline.decode_steps},
              dict.fromkeys([timeline.first_decode.step_id, timeline.last_decode_step_id]))
