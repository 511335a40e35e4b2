"""Presenting results: the terminal table, the progress bar and the JSON document (docs/bench.md)."""
from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from prefixcache.bench.metrics import RequestRecord, RunSummary, ratios

CACHE, NO_CACHE = "cache", "no_cache"
MODE_TITLES = {CACHE: "cache", NO_CACHE: "no cache"}


@dataclass
class WorkloadResult:
    """One workload's summaries and raw records, keyed by mode (`cache`, `no_cache`)."""

    summaries: dict[str, RunSummary] = field(default_factory=dict)
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None] | None:
        if CACHE in self.summaries and NO_CACHE in self.summaries:
            return ratios(self.summaries[CACHE], self.summaries[NO_CACHE])
        return None


def to_json(results: Mapping[str, WorkloadResult], config: Mapping[str, object]) -> dict:
    workloads = {}
    for name, result in results.items():
        entry: dict[str, object] = {mode: summary.to_json() for mode, summary in result.summaries.items()}
        if (r := result.ratios()) is not None:
            entry["ratio"] = r
        workloads[name] = entry
    return {"config": dict(config), "workloads": workloads}


def write_json(path: str, results: Mapping[str, WorkloadResult], config: Mapping[str, object]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump(to_json(results, config), out, indent=2)
        out.write("\n")


# (label, figure name in RunSummary.figures(), format)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("TTFT p50 (ms)", "ttft_ms.p50", "{:.1f}"),
    ("TTFT p90 (ms)", "ttft_ms.p90", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_ms.p99", "{:.1f}"),
    ("ITL p50 (ms)", "itl_ms.p50", "{:.1f}"),
    ("ITL p99 (ms)", "itl_ms.p99", "{:.1f}"),
    ("e2e p50 (ms)", "e2e_ms.p50", "{:.0f}"),
    ("e2e p99 (ms)", "e2e_ms.p99", "{:.0f}"),
    ("requests/s", "requests_per_s", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
    ("prompt tokens", "prompt_tokens", "{:,}"),
    ("cached tokens", "cached_tokens", "{:,}"),
    ("hit rate", "hit_rate", "{:.1%}"),
    ("evictions", "evictions", "{:,}"),
    ("completed", "completed", "{:,}"),
    ("failed", "failed", "{:,}"),
)


def format_cell(value: float | None, fmt: str) -> str:
    """A figure as a table shows it: `-` where there is none."""
    return "-" if value is None else fmt.format(value)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in counts.items()) or "-"


def align_columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Table lines: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]).rstrip()
            for row in rows]


def render_table(results: Mapping[str, WorkloadResult]) -> str:
    lines: list[str] = []
    for name, result in results.items():
        modes = [m for m in (CACHE, NO_CACHE) if m in result.summaries]
        figures = {m: result.summaries[m].figures() for m in modes}
        r = result.ratios()
        header = [name] + [MODE_TITLES[m] for m in modes] + (["cache/no cache"] if r else [])
        rows = [header]
        for label, key, fmt in ROWS:
            row = [f"  {label}"] + [format_cell(figures[m][key], fmt) for m in modes]
            if r is not None:
                row.append(format_cell(r[key], "{:.2f}x"))
            rows.append(row)
        rows.append(["  miss reasons"] + [_counts(result.summaries[m].miss_reasons) for m in modes] + ([""] if r else []))
        if any(result.summaries[m].errors for m in modes):
            rows.append(["  errors"] + [_counts(result.summaries[m].errors) for m in modes] + ([""] if r else []))
        lines += align_columns(rows)
        lines.append("")
    return "\n".join(lines)


class ProgressBar:
    """`label [#####-----] done/total` redrawn in place; silent when the stream is not a terminal."""

    def __init__(self, label: str, total: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self._label, self._total, self._stream, self._width = label, total, stream, width
        self._done = self._failed = 0
        self._live = stream.isatty()
        self._draw()

    def advance(self, record: RequestRecord) -> None:
        self._done += 1
        self._failed += not record.ok
        self._draw()

    def close(self) -> None:
        if self._live:
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self) -> None:
        if not self._live:
            return
        filled = self._width * self._done // max(self._total, 1)
        failed = f", {self._failed} failed" if self._failed else ""
        bar = "#" * filled + "-" * (self._width - filled)
        self._stream.write(f"\r{self._label:<28} [{bar}] {self._done}/{self._total}{failed}")
        self._stream.flush()
