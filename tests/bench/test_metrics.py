"""Report arithmetic against values computed by hand."""
import pytest

from prefixcache.bench.metrics import (
    Percentiles,
    RequestRecord,
    hit_rate_over_time,
    percentile,
    ratios,
    summarize,
)


def test_percentile_interpolates_between_closest_ranks():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40, positions 0..3
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0  # position 1.5
    assert percentile(values, 90) == pytest.approx(37.0)  # position 2.7: 30 + 0.7 * 10
    assert percentile(values, 99) == pytest.approx(39.7)  # position 2.97
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q"):
        percentile(values, 101)


def record(name, sent, chunks, finished, prompt, cached, completion, reason="", error=None):
    return RequestRecord(name, sent, chunks, finished, prompt, cached, completion, reason, "length", error)


def test_request_timings():
    r = record("a", 1.0, [(1.5, 1), (1.7, 2), (1.8, 1)], 1.9, 100, 0, 4)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(0.9)
    # The 2-token message spreads its 0.2 s gap over its two tokens.
    assert r.inter_token_gaps_s() == pytest.approx([0.1, 0.1, 0.1])


def test_summary_by_hand():
    records = [
        record("a", 0.0, [(0.1, 1), (0.3, 1)], 0.3, prompt=1000, cached=0, completion=2, reason="cold"),
        record("b", 0.5, [(0.6, 1), (0.7, 1)], 0.7, prompt=1100, cached=992, completion=2, reason="full_hit"),
        record("c", 1.0, [(1.3, 1), (1.6, 1)], 2.0, prompt=900, cached=896, completion=2, reason="full_hit"),
        record("d", 1.0, [], None, prompt=0, cached=0, completion=0, error="UNAVAILABLE: worker died"),
    ]
    s = summarize(records, evictions=3)
    assert (s.completed, s.failed, s.evictions) == (3, 1, 3)
    assert s.duration_s == pytest.approx(2.0)  # first send 0.0 .. last completion 2.0
    assert s.requests_per_s == pytest.approx(1.5)
    assert s.output_tokens_per_s == pytest.approx(3.0)
    assert (s.prompt_tokens, s.cached_tokens, s.output_tokens) == (3000, 1888, 6)
    assert s.hit_rate == pytest.approx(1888 / 3000)  # token-weighted, not the mean of per-request rates
    assert s.miss_reasons == {"cold": 1, "full_hit": 2}
    # TTFTs 100, 100, 300 ms; e2e 300, 200, 1000 ms; ITL 200, 100, 300 ms.
    assert s.ttft_ms == Percentiles(pytest.approx(100), pytest.approx(260), pytest.approx(296))
    assert s.e2e_ms.p50 == pytest.approx(300) and s.e2e_ms.p90 == pytest.approx(860)
    assert s.itl_ms.p50 == pytest.approx(200) and s.itl_ms.p99 == pytest.approx(298)
    keys = set(s.to_json())
    assert {"ttft_ms", "itl_ms", "e2e_ms", "requests_per_s", "output_tokens_per_s", "prompt_tokens",
            "cached_tokens", "hit_rate", "miss_reasons"} <= keys
    assert s.to_json()["ttft_ms"]["p90"] == pytest.approx(260)


def test_summary_of_nothing():
    s = summarize([])
    assert (s.completed, s.requests_per_s, s.hit_rate, s.ttft_ms.p50) == (0, 0.0, None, None)


def test_ratios_divide_every_figure():
    fast = summarize([record("a", 0.0, [(0.1, 1), (0.2, 1)], 0.2, 1000, 992, 2, "full_hit")])
    slow = summarize([record("a", 0.0, [(0.8, 1), (0.9, 1)], 1.0, 1000, 0, 2, "disabled")])
    r = ratios(fast, slow)
    assert r["ttft_ms.p50"] == pytest.approx(0.125)
    assert r["e2e_ms.p99"] == pytest.approx(0.2)
    assert r["requests_per_s"] == pytest.approx(5.0)
    assert r["prompt_tokens"] == 1.0
    assert r["hit_rate"] is None and r["cached_tokens"] is None  # nothing to divide by
    assert "miss_reasons" not in r and "ttft_ms" not in r


def test_hit_rate_over_time_is_windowed_and_token_weighted():
    records = [
        record("a", 0.0, [(0.1, 1)], 1.0, 100, 0, 1),
        record("b", 0.0, [(0.1, 1)], 3.0, 100, 96, 1),
        record("c", 0.0, [(0.1, 1)], 2.0, 300, 288, 1),
    ]
    assert hit_rate_over_time(records, window=2) == [
        (1.0, 0.0), (2.0, pytest.approx(288 / 400)), (3.0, pytest.approx((288 + 96) / 400))]
