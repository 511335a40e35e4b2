"""Prometheus metrics of the scheduler: prefix-cache effectiveness, block usage, queues, latencies.

Counters and gauges are read from the scheduling policy when Prometheus scrapes (a custom collector),
so the step loop pays nothing per step for them; counters come from `PolicyCounters`, which survive a
worker restart, and block gauges from the KV cache manager in use. Latency histograms are observed as
each request's outputs are delivered. Every sample carries the served model's id as `model_name`, as
vLLM's do. Each `SchedulerMetrics` owns its registry, so several engines (tests) never collide; the
scheduler serves `metrics.registry` over HTTP (`prefixcache.rpc.metrics_http`).

docs/services.md lists each metric beside the vLLM metric it corresponds to.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.rpc.histogram import Histogram
from prefixcache.scheduler.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

if TYPE_CHECKING:
    from prefixcache.scheduler.policy import SchedulingPolicy
    from prefixcache.scheduler.request import EngineRequest, RequestOutput

PREFIX = "prefixcache"
FINISH_ERROR = "error"  # the stream ended UNAVAILABLE: the worker lost, or the tokenizer failing mid-stream
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR)
# Bucket bounds in seconds: a first token and a request's phases from milliseconds (a cached prompt
# on a GPU) to minutes (a long prompt queued on a CPU); the gap between two tokens from 2 ms.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                       7.5, 10.0, 20.0, 40.0, 80.0)
INTER_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                       1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class SchedulerMetrics(Collector):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._policy: SchedulingPolicy | None = None
        self._held: Callable[[], int] = lambda: 0
        self.model_name = ""
        # finish reason -> requests; every reason from the start, so a first error is an increase
        self._finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._generation_tokens = 0
        self._prompt_tokens = 0
        self._worker_losses = 0
        self.kv_events_dropped = 0  # KV events batches a subscriber did not get (it was told so in-band)
        # Per request in flight: when it arrived, and when its last token was delivered.
        self._arrival_ns: dict[str, int] = {}
        self._last_token_ns: dict[str, int] = {}
        self._first_token = Histogram(FIRST_TOKEN_BUCKETS)  # labelled by whether the prefix cache served any token
        self._inter_token = Histogram(INTER_TOKEN_BUCKETS)
        self._end_to_end = Histogram(REQUEST_BUCKETS)
        self._queue = Histogram(REQUEST_BUCKETS)
        self._prefill = Histogram(REQUEST_BUCKETS)
        self.registry.register(self)

    def bind(self, policy: SchedulingPolicy, held: Callable[[], int] = lambda: 0, model_name: str = "") -> None:
        """Read from this policy from now on (a new one is bound after a worker loss); `held` counts
        the requests waiting for a new worker, outside any policy; `model_name` labels every sample."""
        self._policy = policy
        self._held = held
        self.model_name = model_name

    def request_added(self, request: EngineRequest) -> None:
        self._prompt_tokens += len(request.prompt_token_ids)
        self._arrival_ns.setdefault(request.request_id, request.arrival_ns or time.time_ns())

    def output_delivered(self, output: RequestOutput) -> None:
        """Count an engine output's tokens and time them (its reader counts the finish: `request_finished`)."""
        self._generation_tokens += len(output.new_token_ids)
        request_id = output.request_id
        now = time.time_ns()
        if output.new_token_ids:
            last = self._last_token_ns.get(request_id)
            if last is not None:
                self._inter_token.observe((now - last) / 1e9)
            elif request_id in self._arrival_ns and output.cache_account is not None:
                hit = "true" if output.cache_account.hit_tokens else "false"
                self._first_token.observe((now - self._arrival_ns[request_id]) / 1e9, (hit,))
            self._last_token_ns[request_id] = now
        if output.finished:
            arrival = self._arrival_ns.pop(request_id, None)
            self._last_token_ns.pop(request_id, None)
            if arrival is not None:
                self._end_to_end.observe((now - arrival) / 1e9)
            timeline = output.timeline
            if timeline is not None and timeline.admitted_ns is not None:
                self._queue.observe((timeline.admitted_ns - timeline.queued_ns) / 1e9)
                if timeline.first_token_ns is not None:
                    self._prefill.observe((timeline.first_token_ns - timeline.admitted_ns) / 1e9)

    def request_finished(self, reason: str) -> None:
        """A request ended for `reason`, as its client was told."""
        self._finished[reason] += 1

    def kv_events_missed(self, batches: int) -> None:
        """A KV events subscriber was told it missed `batches` batches (they left the replay buffer)."""
        self.kv_events_dropped += batches

    def worker_lost(self) -> None:
        self._worker_losses += 1

    def request_failed(self, request_id: str) -> None:
        """A request lost with the worker: its stream ends with UNAVAILABLE, not with an output."""
        self._arrival_ns.pop(request_id, None)
        self._last_token_ns.pop(request_id, None)
        self.request_finished(FINISH_ERROR)

    def exposition(self) -> bytes:
        """The text format, as an HTTP /metrics handler returns it."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        model = [self.model_name]

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def by(name: str, documentation: str, label: str, values: dict[str, int], kind=CounterMetricFamily) -> Metric:
            family = kind(f"{PREFIX}_{name}", documentation, labels=["model_name", label])
            for value, count in sorted(values.items()):
                family.add_metric([*model, value], count)
            return family

        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", self._prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", self._generation_tokens)
        yield counter("worker_losses", "Times the worker was lost and re-initialized.", self._worker_losses)
        yield counter("kv_events_dropped", "KV events batches a subscriber did not get: dropped from the replay "
                      "buffer before it read them (it was told so in-band).", self.kv_events_dropped)
        yield by("requests_finished", "Requests finished, by finish reason: stop, length, abort, or error (lost with "
                 "the worker).", "finish_reason", self._finished)
        yield from self._histograms(model)
        if self._policy is None:
            return
        counters = self._policy.counters
        lookups = counters.lookups
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", counters.queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache (the last token's block of "
                      "a full match is recomputed, not served).", counters.hit_tokens)
        yield counter("prefix_cache_lookups", "Requests' first prefix-cache lookups.", lookups.lookups)
        yield counter("prefix_cache_evicted_lookups", "First lookups that stopped at a block evicted to make room.",
                      lookups.evicted_lookups)
        yield counter("prefix_cache_ghost_hits", "First lookups that a KV cache four times as large would have "
                      "served more tokens of (exact for LRU: prefixcache diagnose).", lookups.ghost_hits)
        yield by("prefix_cache_missed_tokens", "Prompt tokens not served from the prefix cache, by reason: cold, "
                 "evicted, capped (a full match's last block, recomputed) or partial_tail (after the last full "
                 "block).", "reason", lookups.missed_tokens)
        yield counter("prefix_cache_evictions", "Cached blocks evicted to make room.", counters.evictions)
        yield counter("preemptions", "Requests preempted (recomputed) for lack of KV blocks.", counters.preemptions)
        yield counter("steps", "Scheduler steps executed.", counters.steps)
        yield counter("steps_scheduled_ahead", "Scheduler steps sent while the step before them was still running.",
                      counters.steps_ahead)
        stats = self._policy.kv_cache.stats()
        # The states partition the pool, so sum() is the pool's size; "cached" cuts across them.
        yield by("kv_blocks", "KV blocks: used (held by requests) or free (including cached ones no request holds).",
                 "state", {"used": stats.used_blocks, "free": stats.free_blocks}, GaugeMetricFamily)
        yield gauge("kv_cache_usage_perc", "Fraction of the KV blocks held by requests (0 to 1).",
                    stats.used_blocks / stats.num_blocks)
        yield gauge("kv_cached_blocks", "KV blocks holding reusable KV, used or free.", stats.cached_blocks)
        yield gauge("kv_cached_idle_blocks", "Cached KV blocks no request holds: the next evicted, oldest first.",
                    stats.idle_cached_blocks)
        yield gauge("requests_running", "Requests holding KV blocks.", self._policy.num_running)
        yield gauge("requests_waiting", "Requests waiting for admission (or for a worker).",
                    self._policy.num_waiting + self._held())

    def _histograms(self, model: list[str]) -> Iterator[Metric]:
        just_model: Callable[[tuple[str, ...]], list[str]] = lambda labels: [*model, *labels]
        yield self._first_token.family(
            f"{PREFIX}_time_to_first_token_seconds", "From the call's arrival to its first token, by whether the "
            "prefix cache served any of its prompt.", ["model_name", "prefix_cache_hit"], just_model)
        yield self._inter_token.family(f"{PREFIX}_inter_token_latency_seconds", "Between two tokens of a request.",
                                       ["model_name"], just_model)
        yield self._end_to_end.family(f"{PREFIX}_e2e_request_latency_seconds", "From the call's arrival to the "
                                      "request's end.", ["model_name"], just_model)
        yield self._queue.family(f"{PREFIX}_request_queue_time_seconds", "Waiting for admission (the cache "
                                 "lookup that admitted it ends the wait).", ["model_name"], just_model)
        yield self._prefill.family(f"{PREFIX}_request_prefill_time_seconds", "From admission to the first token.",
                                   ["model_name"], just_model)
