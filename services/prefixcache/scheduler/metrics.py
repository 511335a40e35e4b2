"""Prometheus metrics of the scheduler: prefix-cache effectiveness, block usage, queues.

Everything is read from the scheduling policy when Prometheus scrapes (a custom collector), so the step
loop pays nothing per step. Counters come from `PolicyCounters`, which survive a worker restart; block
gauges come from the KV cache manager in use. Each `SchedulerMetrics` owns its registry, so several
engines (tests) never collide; the services engineer serves `metrics.registry` over HTTP.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.scheduler.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

if TYPE_CHECKING:
    from prefixcache.scheduler.policy import SchedulingPolicy
    from prefixcache.scheduler.request import RequestOutput

PREFIX = "prefixcache"
FINISH_ERROR = "error"  # the stream ended UNAVAILABLE: the worker lost, or the tokenizer failing mid-stream
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR)


class SchedulerMetrics(Collector):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._policy: SchedulingPolicy | None = None
        # finish reason -> requests; every reason from the start, so a first error is an increase
        self._finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._generation_tokens = 0
        self._prompt_tokens = 0
        self._worker_losses = 0
        self.registry.register(self)

    def bind(self, policy: SchedulingPolicy, held: Callable[[], int] = lambda: 0) -> None:
        """Read from this policy from now on (a new one is bound after a worker loss); `held` counts
        the requests waiting for a new worker, outside any policy."""
        self._policy = policy
        self._held = held

    def request_added(self, prompt_tokens: int) -> None:
        self._prompt_tokens += prompt_tokens

    def output_delivered(self, output: RequestOutput) -> None:
        """Count an engine output's tokens (its reader counts the finish: `request_finished`)."""
        self._generation_tokens += len(output.new_token_ids)

    def request_finished(self, reason: str) -> None:
        """A request ended for `reason`, as its client was told."""
        self._finished[reason] += 1

    def worker_lost(self) -> None:
        self._worker_losses += 1

    def request_failed(self) -> None:
        """A request lost with the worker: its stream ends with UNAVAILABLE, not with an output."""
        self.request_finished(FINISH_ERROR)

    def exposition(self) -> bytes:
        """The text format, as an HTTP /metrics handler returns it."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=value)

        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", self._prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", self._generation_tokens)
        yield counter("worker_losses", "Times the worker was lost and re-initialized.", self._worker_losses)
        finished = CounterMetricFamily(
            f"{PREFIX}_requests_finished",
            "Requests finished, by finish reason: stop, length, abort, or error (lost with the worker).",
            labels=["finish_reason"],
        )
        for reason, count in sorted(self._finished.items()):
            finished.add_metric([reason], count)
        yield finished
        if self._policy is None:
            return
        counters = self._policy.counters
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", counters.queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache (the last token's block of "
                      "a full match is recomputed, not served).", counters.hit_tokens)
        yield counter("prefix_cache_evictions", "Cached blocks evicted to make room.", counters.evictions)
        yield counter("preemptions", "Requests preempted (recomputed) for lack of KV blocks.", counters.preemptions)
        yield counter("steps", "Scheduler steps executed.", counters.steps)
        yield counter("steps_scheduled_ahead", "Scheduler steps sent while the step before them was still running.",
                      counters.steps_ahead)
        stats = self._policy.kv_cache.stats()
        # The states partition the pool, so sum() is the pool's size; "cached" cuts across them.
        blocks = GaugeMetricFamily(
            f"{PREFIX}_kv_blocks",
            "KV blocks: used (held by requests) or free (including cached ones no request holds).",
            labels=["state"],
        )
        blocks.add_metric(["used"], stats.used_blocks)
        blocks.add_metric(["free"], stats.free_blocks)
        yield blocks
        yield GaugeMetricFamily(f"{PREFIX}_kv_cached_blocks", "KV blocks holding reusable KV, used or free.",
                                value=stats.cached_blocks)
        yield GaugeMetricFamily(f"{PREFIX}_requests_running", "Requests holding KV blocks.", value=self._policy.num_running)
        yield GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Requests waiting for admission (or for a worker).",
                                value=self._policy.num_waiting + self._held())
