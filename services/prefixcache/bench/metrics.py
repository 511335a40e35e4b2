"""What one benchmark run measured, and the arithmetic that turns it into a report.

Definitions (also in docs/bench.md):
- TTFT: from sending the request to the first streamed message that carries a token.
- ITL: the gap between consecutive token-carrying messages; a message carrying k tokens counts as
  k inter-token gaps of gap/k each, so batched streaming does not hide latency.
- e2e: from sending the request to its last message.
- Throughput: completed requests (or their output tokens) divided by the run's wall time, from the
  first send to the last completion.
- Hit rate: cached prompt tokens / prompt tokens, summed over requests (token-weighted).
- Percentiles: linear interpolation between closest ranks (numpy's default method).
- Ratios: with-cache figure / without-cache figure; None where the latter is zero or missing.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are seconds on the run's monotonic clock."""

    request_id: str
    sent_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the message)
    finished_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    miss_reason: str = ""  # as reported by the server's cache account; "" when it reported none
    finish_reason: str = ""
    error: str | None = None  # gRPC status code name and message when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_s is not None

    @property
    def error_code(self) -> str | None:
        """The gRPC status code name of a failed request; None if it did not fail."""
        return None if self.error is None else self.error.split(":", 1)[0]

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.sent_s if self.chunks else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.sent_s

    def inter_token_gaps_s(self) -> list[float]:
        gaps: list[float] = []
        for (previous, _), (now, tokens) in zip(self.chunks, self.chunks[1:]):
            gaps.extend([(now - previous) / tokens] * tokens)
        return gaps


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) by linear interpolation; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_ms(cls, seconds: Sequence[float]) -> Percentiles:
        ms = [s * 1000 for s in seconds]
        return cls(percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The figures of one workload in one mode; `to_json()` gives the documented JSON keys."""

    completed: int
    failed: int
    duration_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    hit_rate: float | None
    miss_reasons: dict[str, int]
    evictions: int | None  # from GetCacheStats before and after; None when the server has no counter
    errors: dict[str, int] = field(default_factory=dict)  # gRPC status code name -> failed requests

    def to_json(self) -> dict:
        return asdict(self)

    def figures(self) -> dict[str, float | None]:
        """Every numeric figure under a flat name (`ttft_ms.p50`, `hit_rate`, ...)."""
        flat: dict[str, float | None] = {}
        for name, value in self.to_json().items():
            if name in _COUNTS_BY_NAME:
                continue
            if isinstance(value, dict):
                flat.update({f"{name}.{key}": inner for key, inner in value.items()})
            else:
                flat[name] = value
        return flat


_COUNTS_BY_NAME = ("miss_reasons", "errors")  # RunSummary's counts per value, not figures


def summarize(records: Sequence[RequestRecord], evictions: int | None = None) -> RunSummary:
    done = [r for r in records if r.ok]
    if records:
        start = min(r.sent_s for r in records)
        end = max((r.finished_s for r in done), default=start)
        duration = end - start
    else:
        duration = 0.0
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    output = sum(r.completion_tokens for r in done)
    reasons = Counter(r.miss_reason for r in done if r.miss_reason)
    errors = Counter(r.error_code or "INCOMPLETE" for r in records if not r.ok)
    return RunSummary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration,
        ttft_ms=Percentiles.of_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        itl_ms=Percentiles.of_ms([gap for r in done for gap in r.inter_token_gaps_s()]),
        e2e_ms=Percentiles.of_ms([r.e2e_s for r in done]),
        requests_per_s=len(done) / duration if duration > 0 else 0.0,
        output_tokens_per_s=output / duration if duration > 0 else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        hit_rate=cached / prompt if prompt else None,
        miss_reasons=dict(sorted(reasons.items())),
        evictions=evictions,
        errors=dict(sorted(errors.items())),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def ratios(with_cache: RunSummary, without_cache: RunSummary) -> dict[str, float | None]:
    """with-cache / without-cache for every numeric figure (below 1 means the cache made it smaller)."""
    theirs = without_cache.figures()
    return {name: ratio(value, theirs[name]) for name, value in with_cache.figures().items()}


def hit_rate_over_time(records: Sequence[RequestRecord], window: int = 8) -> list[tuple[float, float]]:
    """(completion time, token-weighted hit rate of the last `window` completed requests)."""
    done = sorted((r for r in records if r.ok), key=lambda r: r.finished_s)
    points = []
    for i, record in enumerate(done):
        recent = done[max(0, i + 1 - window) : i + 1]
        prompt = sum(r.prompt_tokens for r in recent)
        if prompt:
            points.append((record.finished_s, sum(r.cached_tokens for r in recent) / prompt))
    return points
