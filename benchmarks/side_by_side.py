"""Systems compared side by side on the same requests (vs_vllm.py, vs_transformers.py): each workload
runs through every system back to back, and one table per workload divides by a baseline system."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prefixcache.bench.driver import StreamingEndpoint, TenantSalts, drive
from prefixcache.bench.engine import EngineEndpoint
from prefixcache.bench.metrics import RunSummary, ratio, summarize
from prefixcache.bench.report import ROWS, ProgressBar, align_columns, format_cell
from prefixcache.bench.workloads import BenchRequest


@dataclass(frozen=True)
class ComparedSystem:
    """One side of an interleaved comparison."""

    name: str
    endpoint: StreamingEndpoint
    concurrency: int
    owned_engine: EngineEndpoint | None = None  # a prefixcache engine this run started: emptied per workload


def _to_stderr(note: str) -> None:
    print(f"note: {note}", file=sys.stderr)


async def run_interleaved(requests: dict[str, list[BenchRequest]], systems: Sequence[ComparedSystem], tenants: int,
                          note: Callable[[str], None] = _to_stderr) -> dict[str, dict[str, RunSummary]]:
    """Each workload through every system back to back, the order rotating from one workload to the
    next, so that a drift in the machine's speed lands on every side rather than on whichever ran
    last. Returns the summaries by system, then workload."""
    summaries: dict[str, dict[str, RunSummary]] = {system.name: {} for system in systems}
    order = list(systems)
    for name, batch in requests.items():
        for system in order:
            if system.owned_engine is not None and not await system.owned_engine.reset_prefix_cache():
                note(f"{system.name} refused to reset its prefix cache before {name}")
            bar = ProgressBar(f"{name} ({system.name})", len(batch))
            run = await drive(system.endpoint, batch, system.concurrency, TenantSalts(tenants), on_done=bar.advance)
            bar.close()
            evictions = run.evictions if isinstance(system.endpoint, EngineEndpoint) else None
            summaries[system.name][name] = summarize(run.records, evictions)
        order = order[1:] + order[:1]
    return summaries


def render_systems(summaries: Mapping[str, Mapping[str, RunSummary]], baseline: str) -> str:
    """Compare systems on the same workloads: `summaries[system][workload]`, one block per workload,
    one column per system, then each other system's figure divided by `baseline`'s."""
    systems = list(summaries)
    if baseline not in summaries:
        raise ValueError(f"baseline must be one of {', '.join(systems)}, got {baseline!r}")
    others = [s for s in systems if s != baseline]
    workloads = list(dict.fromkeys(w for per_system in summaries.values() for w in per_system))
    lines: list[str] = []
    for workload in workloads:
        present = [s for s in systems if workload in summaries[s]]
        figures = {s: summaries[s][workload].figures() for s in present}
        compared = [s for s in others if s in present and baseline in present]
        rows = [[workload] + present + [f"{s} / {baseline}" for s in compared]]
        for label, key, fmt in ROWS:
            row = [f"  {label}"] + [format_cell(figures[s][key], fmt) for s in present]
            row += [format_cell(ratio(figures[s][key], figures[baseline][key]), "{:.2f}x") for s in compared]
            rows.append(row)
        lines += align_columns(rows)
        lines.append("")
    return "\n".join(lines)
