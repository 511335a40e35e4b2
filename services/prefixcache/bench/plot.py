"""`--plot FILE.png`: per workload, the TTFT distribution with and without the cache, and the hit
rate over time (a sliding window of recent completions, token-weighted)."""
from __future__ import annotations

from collections.abc import Mapping

from prefixcache.bench.metrics import hit_rate_over_time
from prefixcache.bench.report import MODE_TITLES, WorkloadResult


def plot(path: str, results: Mapping[str, WorkloadResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 2, figsize=(11, 3.2 * len(results)), squeeze=False)
    for (name, result), (ttft_axis, hit_axis) in zip(results.items(), axes):
        for mode, records in result.records.items():
            ttfts = sorted(r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None)
            if ttfts:
                fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                ttft_axis.step(ttfts, fractions, where="post", label=MODE_TITLES[mode])
            points = hit_rate_over_time(records)
            if points:
                hit_axis.plot([t for t, _ in points], [h for _, h in points], marker=".", label=MODE_TITLES[mode])
        ttft_axis.set(title=f"{name}: TTFT distribution", xlabel="TTFT (ms)", ylabel="fraction of requests")
        ttft_axis.set_xscale("log")
        hit_axis.set(title=f"{name}: hit rate over time", xlabel="time since start (s)", ylabel="hit rate", ylim=(-0.02, 1.02))
        for axis in (ttft_axis, hit_axis):
            if axis.get_legend_handles_labels()[0]:  # nothing drawn (every request failed): no legend
                axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
