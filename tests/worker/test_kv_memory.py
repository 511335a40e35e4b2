"""Parsing the KV cache memory budget."""
from __future__ import annotations

import pytest

from prefixcache.services.worker.kv_memory import free_device_memory, kv_cache_budget_bytes


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1073741824", 2**30), ("64 kib", 65536)],
)
def test_sizes(spec: str, expected: int) -> None:
    assert kv_cache_budget_bytes(spec) == expected


def test_fraction_of_free_memory() -> None:
    import torch

    free = free_device_memory(torch.device("cpu"))
    assert free > 0
    assert kv_cache_budget_bytes("0.25") == pytest.approx(free / 4, rel=0.05)  # free memory moves a little


@pytest.mark.parametrize("spec", ["", "lots", "2 parsecs", "1.5.2", "0.0", "1.5", "-3GiB", "0GiB"])
def test_malformed_budgets_are_named(spec: str) -> None:
    with pytest.raises(ValueError, match="kv cache memory"):
        kv_cache_budget_bytes(spec)
