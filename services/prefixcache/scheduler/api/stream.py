"""One Generate call's responses: the engine's outputs with their text (detokenized incrementally
by the tokenizer service), cut at a stop string, and the summary its span and the metrics record."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.rpc.tracing import SpanRegistry
from prefixcache.scheduler.api.codec import FINISH_REASONS, account_to_proto
from prefixcache.scheduler.api.spans import (
    account_attributes,
    add_phase_spans,
    eviction_attributes,
    evictor_link,
    storer_links,
)
from prefixcache.scheduler.engine import EngineCore, RequestOutput
from prefixcache.scheduler.kv_cache import CacheAccount, EvictionBatch
from prefixcache.scheduler.request import FINISH_ABORT, FINISH_STOP, RequestTimeline
from prefixcache.scheduler.stop_strings import StopStringMatcher
from prefixcache.scheduler.tokenizer_client import StreamingDetokenizer
from prefixcache.step.codec import logprobs_to_proto


class ResponseStream:
    """Turns one request's engine outputs into responses: text, stop strings, the final summary."""

    def __init__(self, request_id: str, engine_id: str, engine: EngineCore, detokenizer: StreamingDetokenizer,
                 stops: list[str], arrival_ns: int, step_spans: SpanRegistry | None = None):
        self._request_id = request_id  # the client's, echoed in every response
        self._engine_id = engine_id  # the engine's (`access.engine_request_id`)
        self._engine = engine
        self._arrival_ns = arrival_ns
        self._step_spans = step_spans or SpanRegistry()
        self.first_token_ns: int | None = None  # when the first token ids were sent to the client
        self.timeline: RequestTimeline | None = None
        self._detokenizer = detokenizer
        self._stops = StopStringMatcher(stops)
        # The stream, not the engine, tells the metrics why the request ended: as the client was
        # told, which a stop string or a failed tokenizer can make differ from the engine's reason.
        self._engine_finish_reason: str | None = None  # of the final output, once absorbed
        self._unread_reason: str | None = None  # why a stream that ended without its final response ended
        self.finished = False
        self.last: RequestOutput | None = None
        self.account: CacheAccount | None = None
        self.evictions: list[EvictionBatch] = []
        self.delivered_tokens = 0  # token ids sent to the client

    async def responses(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[pb.GenerateResponse]:
        """Responses for the engine's outputs. Once a stop string matched, the tokens the engine
        generated meanwhile (it runs ahead of detokenizing) are dropped: the client gets the ids up
        to the one completing the match, and the usage counts those."""
        async for output in outputs:
            self.last = output
            self.absorb(output)
            if self._stops.stopped:
                if output.finished:
                    yield self._final(output, "", with_tokens=False)
                    return
                continue
            # The token that stopped the request (EOS or a stop token id) stays in the ids but adds no
            # text, as in vLLM: a stop token's text is a delimiter, not part of the answer.
            stopped_by_token = output.finished and output.finish_reason == FINISH_STOP
            text_ids = output.new_token_ids[:-1] if stopped_by_token else output.new_token_ids
            new_text = await self._detokenizer.push(text_ids, last=output.finished)
            text = self._stops.push(new_text, final=output.finished)
            self.delivered_tokens += len(output.new_token_ids)
            if self._stops.stopped:
                # Its final output, with the usage, follows, finished for reason "stop".
                self._engine.abort(self._engine_id, FINISH_STOP)
            if output.finished:
                yield self._final(output, text)
                return
            if output.new_token_ids or text or output.cache_account is not None:
                yield self._response(output, text, None)

    def _final(self, output: RequestOutput, text: str, with_tokens: bool = True) -> pb.GenerateResponse:
        """The last response. A matched stop string makes the reason "stop", also where the engine
        had finished the request first (it runs ahead of detokenizing)."""
        self.finished = True
        reason = FINISH_STOP if self._stops.stopped else output.finish_reason
        self._engine.metrics.request_finished(reason)
        return self._response(output, text, reason, with_tokens)

    def end_unread(self, told: str | None, count: bool = True) -> None:
        """For a stream that ended without its final response: its reason is `told`, what the call
        ended with, if it failed; otherwise (cancelled, deadline) the reason of the engine's final
        output, absorbed since, if there was one. Counted unless the engine counted it already."""
        self._unread_reason = told or (FINISH_STOP if self._stops.stopped else self._engine_finish_reason)
        if count and self._unread_reason is not None:
            self._engine.metrics.request_finished(self._unread_reason)

    def _response(self, output: RequestOutput, text: str, reason: str | None,
                  with_tokens: bool = True) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=self._request_id, text=text)
        if with_tokens and output.new_token_ids and self.first_token_ns is None:
            self.first_token_ns = time.time_ns()
        if with_tokens:
            response.token_ids.extend(output.new_token_ids)
            response.logprobs.extend(logprobs_to_proto(logprobs) for logprobs in output.logprobs)
        if output.cache_account is not None:
            response.cache_account.CopyFrom(account_to_proto(output.cache_account))
        if reason is not None:
            response.finish_reason = FINISH_REASONS[reason]
        if output.usage is not None:
            response.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=output.usage.prompt_tokens,
                    cached_tokens=output.usage.cached_tokens,
                    completion_tokens=self.delivered_tokens,
                )
            )
        return response

    async def close(self) -> None:
        await self._detokenizer.close()

    def annotate(self, span: trace.Span) -> None:
        """Usage, time to first token, cache account, evictions and the request's phases on its span
        (hashes only, never text).

        A stream that ended before its final response reports the tokens it delivered and the
        reason it was counted under ("error" for a failed call, "abort" for a client that left)."""
        span.set_attribute("gen_ai.usage.output_tokens", self.delivered_tokens)
        if self.first_token_ns is not None:  # named as the GenAI conventions' server metric, in seconds
            span.set_attribute("gen_ai.server.time_to_first_token", (self.first_token_ns - self._arrival_ns) / 1e9)
        if self._stops.stopped:
            reason = "stop"
        elif self.finished and self.last is not None and self.last.finish_reason is not None:
            reason = self.last.finish_reason
        else:
            reason = self._unread_reason or FINISH_ABORT
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        if not span.is_recording():
            return
        timeline = self.timeline
        if self.account is not None:
            lookup_ns = timeline.lookup_ns if timeline is not None and timeline.lookup_ns else time.time_ns()
            span.set_attributes(account_attributes(self.account, lookup_ns))
            if (link := evictor_link(self.account)) is not None:
                span.add_link(link.context, link.attributes)
        for batch in self.evictions:
            span.add_event("prefix_cache.eviction", eviction_attributes(batch), timestamp=batch.evicted_at_ns)
        for link in storer_links(self.evictions):
            span.add_link(link.context, link.attributes)
        if timeline is not None:
            add_phase_spans(span, timeline, self._step_spans)

    def absorb(self, output: RequestOutput | None) -> None:
        """Take an output's cache account and evictions for the span: each output streamed, and
        those the stream never read (the call ended first: cancelled before its first token, say)."""
        if output is None:
            return
        if output.finish_reason is not None:
            self._engine_finish_reason = output.finish_reason
        if output.timeline is not None:
            self.timeline = output.timeline
        self.evictions.extend(output.evictions)
        if output.cache_account is not None:
            self.account = output.cache_account
