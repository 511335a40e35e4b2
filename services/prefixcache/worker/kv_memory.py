"""The KV cache memory budget, as given on the command line: bytes, or a fraction of device memory.

    "2GiB", "512MiB", "1.5GB", "1073741824"  → that many bytes
    "0.4"                                     → 40% of the memory free on the device right now
                                                (CUDA: free GPU memory; CPU: MemAvailable, capped
                                                by the headroom under a cgroup memory limit)

Take the fraction after the model is loaded, so the weights are already accounted for.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_kv_cache_memory(spec: str) -> int | float:
    """`spec` as bytes (int) or as a fraction of free device memory (float in (0, 1]); ValueError
    naming the value if malformed. Cheap: check a flag with it before loading a model."""
    match = _BUDGET.match(spec)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"kv cache memory {spec!r} must be bytes (e.g. 2GiB, 512MiB, 1073741824) "
                         "or a fraction of free device memory in (0, 1]")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and "." in match.group(1):
        if not 0 < number <= 1:
            raise ValueError(f"kv cache memory fraction {spec!r} must be in (0, 1]")
        return number
    budget = int(number * _UNITS[unit])
    if budget <= 0:
        raise ValueError(f"kv cache memory {spec!r} must be positive")
    return budget


def kv_cache_budget_bytes(spec: str, device: torch.device | str = "cpu") -> int:
    """Bytes for the KV cache from `spec` (see the module docstring), a fraction taken of what is free
    now; ValueError for bytes beyond what is free (allocating them would end in the OOM killer, or an
    allocator error that does not say which setting asked for so much)."""
    budget = parse_kv_cache_memory(spec)
    if isinstance(budget, float):
        return int(budget * free_device_memory(torch.device(device)))
    try:
        free = free_device_memory(torch.device(device))
    except (OSError, RuntimeError):  # cannot tell (no /proc/meminfo): take the bytes as given
        return budget
    if budget > free:
        raise ValueError(f"kv cache memory of {budget} bytes is more than the {free} bytes free on {device}; "
                         "give fewer bytes, or a fraction of free memory (e.g. 0.4)")
    return budget


def free_device_memory(device: torch.device) -> int:
    """Bytes free on `device`: CUDA's free memory; on CPU, MemAvailable, capped by the headroom
    under this process's cgroup memory limit (a pod's limit, which MemAvailable does not see)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
        else:
            raise RuntimeError("/proc/meminfo has no MemAvailable line")
    headroom = cgroup_memory_headroom()
    return available if headroom is None else min(available, headroom)


# cgroup v1 reports "no limit" as a page-rounded LONG_MAX.
_V1_UNLIMITED = 1 << 62


def cgroup_memory_headroom(cgroup_root: Path = Path("/sys/fs/cgroup"),
                           self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Limit minus usage of this process's memory cgroup, or None without a limit (or a cgroup).

    cgroup v2: `<root>/<path>/memory.max` and `memory.current`; v1: the `memory` controller's
    `memory.limit_in_bytes` and `memory.usage_in_bytes`. Inside a container the process's cgroup is
    usually the mount's root, so the root is tried when the named path is not mounted.
    """
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # v2
            base, limit_file, usage_file = cgroup_root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base, limit_file, usage_file = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for directory in (base / relative, base):
            try:
                limit_text = (directory / limit_file).read_text().strip()
                usage = int((directory / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if limit_text == "max" or int(limit_text) >= _V1_UNLIMITED:
                break  # this cgroup has no limit; an enclosing one might, but is not visible here
            return max(int(limit_text) - usage, 0)
    return None
