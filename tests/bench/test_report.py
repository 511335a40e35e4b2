"""The terminal tables and the JSON document."""
import io
import json

import pytest

from prefixcache.bench.metrics import RequestRecord, summarize
from prefixcache.bench.report import ProgressBar, WorkloadResult, render_table, to_json


def run(ttft, finished, cached, reason):
    return summarize([RequestRecord("r", 0.0, [(ttft, 1), (finished, 1)], finished, 1000, cached, 2, reason, "")], evictions=0)


FAST, SLOW = run(0.1, 0.5, 992, "cold"), run(0.8, 2.0, 0, "disabled")


def rows(text):
    return {line.strip().split("  ")[0]: line.split() for line in text.splitlines() if line.startswith("  ")}


def test_table_shows_both_modes_and_ratio():
    text = render_table({"shared-system-prompt": WorkloadResult({"cache": FAST, "no_cache": SLOW})})
    assert text.splitlines()[0].split() == ["shared-system-prompt", "cache", "no", "cache", "cache/no", "cache"]
    table = rows(text)
    assert table["TTFT p50 (ms)"][-3:] == ["100.0", "800.0", "0.12x"]
    assert table["requests/s"][-3:] == ["2.00", "0.50", "4.00x"]
    assert table["hit rate"][-3:] == ["99.2%", "0.0%", "-"]
    assert table["miss reasons"][-4:] == ["cold", "1", "disabled", "1"]


def test_table_with_one_mode_has_no_ratio_column():
    text = render_table({"unique": WorkloadResult({"cache": SLOW})})
    assert "cache/no cache" not in text and rows(text)["TTFT p50 (ms)"][-1] == "800.0"


def test_json_document_has_modes_and_ratios():
    document = json.loads(json.dumps(to_json({"few-shot": WorkloadResult({"cache": FAST, "no_cache": SLOW})}, {"seed": 0})))
    entry = document["workloads"]["few-shot"]
    assert set(entry) == {"cache", "no_cache", "ratio"}
    assert entry["ratio"]["ttft_ms.p50"] == pytest.approx(0.125)
    assert entry["cache"]["miss_reasons"] == {"cold": 1} and document["config"] == {"seed": 0}


def test_progress_bar_draws_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    bar = ProgressBar("unique (cache)", 4, stream=screen, width=8)
    bar.advance(RequestRecord("a", 0.0, finished_s=1.0))
    bar.advance(RequestRecord("b", 0.0, error="UNAVAILABLE: worker died"))
    bar.close()
    assert screen.getvalue().split("\r")[-1].rstrip("\n").endswith("[####----] 2/4, 1 failed")
    quiet = io.StringIO()
    ProgressBar("unique (cache)", 4, stream=quiet).close()
    assert quiet.getvalue() == ""


def test_a_workload_whose_requests_all_failed_plots_without_warnings(tmp_path):
    pytest.importorskip("matplotlib")
    import warnings

    from prefixcache.bench.plot import plot

    failed = [RequestRecord("r", 0.0, error="DEADLINE_EXCEEDED: deadline exceeded")]
    good = [RequestRecord("r", 0.0, [(0.1, 1), (0.5, 1)], 0.5, 1000, 992, 2, "cold", "")]
    results = {"unique": WorkloadResult({"cache": summarize(failed)}, {"cache": failed}),
               "few-shot": WorkloadResult({"cache": summarize(good)}, {"cache": good})}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(str(tmp_path / "bench.png"), results)
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert summarize(failed).errors == {"DEADLINE_EXCEEDED": 1}
