"""Parsing the KV cache memory budget."""
from __future__ import annotations

import pytest

from prefixcache.worker.kv_memory import cgroup_memory_headroom, free_device_memory, kv_cache_budget_bytes


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


def test_bytes_beyond_free_memory_are_refused() -> None:
    import torch

    free = free_device_memory(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kv cache memory of \d+ bytes is more than the \d+ bytes free on cpu"):
        kv_cache_budget_bytes(str(2 * free))


@pytest.mark.parametrize("spec", ["", "lots", "2 parsecs", "1.5.2", "0.0", "1.5", "-3GiB", "0GiB"])
def test_malformed_budgets_are_named(spec: str) -> None:
    with pytest.raises(ValueError, match="kv cache memory"):
        kv_cache_budget_bytes(spec)


def _fake_cgroups(tmp_path, self_cgroup: str, files: dict[str, str]):
    for relative, content in files.items():
        path = tmp_path / "fs" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    (tmp_path / "self").write_text(self_cgroup)
    return tmp_path / "fs", tmp_path / "self"


def test_cgroup_v2_limit_caps_free_memory(tmp_path) -> None:
    root, self_cgroup = _fake_cgroups(tmp_path, "0::/kubepods/pod1/worker\n", {
        "kubepods/pod1/worker/memory.max": "4294967296\n",
        "kubepods/pod1/worker/memory.current": "1073741824\n",
    })
    assert cgroup_memory_headroom(root, self_cgroup) == 3 * 2**30


def test_cgroup_v2_inside_a_container_reads_the_mount_root(tmp_path) -> None:
    # With a cgroup namespace the process sees its own cgroup as "/" and the files at the mount root.
    root, self_cgroup = _fake_cgroups(tmp_path, "0::/\n", {"memory.max": "2147483648", "memory.current": "2147483648"})
    assert cgroup_memory_headroom(root, self_cgroup) == 0


def test_cgroup_v1_limit_and_unlimited(tmp_path) -> None:
    limited, self_limited = _fake_cgroups(tmp_path / "a", "4:memory:/job\n3:cpu:/job\n", {
        "memory/job/memory.limit_in_bytes": "1073741824",
        "memory/job/memory.usage_in_bytes": "536870912",
    })
    assert cgroup_memory_headroom(limited, self_limited) == 2**29
    unlimited, self_unlimited = _fake_cgroups(tmp_path / "b", "4:memory:/job\n", {
        "memory/job/memory.limit_in_bytes": "9223372036854771712",
        "memory/job/memory.usage_in_bytes": "536870912",
    })
    assert cgroup_memory_headroom(unlimited, self_unlimited) is None


def test_no_limit_or_no_cgroup_means_no_cap(tmp_path) -> None:
    root, self_cgroup = _fake_cgroups(tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max",
                                                                     "user.slice/memory.current": "123"})
    assert cgroup_memory_headroom(root, self_cgroup) is None
    assert cgroup_memory_headroom(tmp_path / "nowhere", tmp_path / "missing") is None
