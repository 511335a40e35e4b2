"""The KV cache memory budget, as given on the command line: bytes, or a fraction of device memory.

    "2GiB", "512MiB", "1.5GB", "1073741824"  → that many bytes
    "0.4"                                     → 40% of the memory free on the device right now
                                                (CUDA: free GPU memory; CPU: MemAvailable)

Take the fraction after the model is loaded, so the weights are already accounted for.
"""
from __future__ import annotations

import re

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def kv_cache_budget_bytes(spec: str, device: torch.device | str = "cpu") -> int:
    """Bytes for the KV cache from `spec` (see the module docstring); ValueError naming the value if malformed."""
    match = _BUDGET.match(spec)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"kv cache memory {spec!r} must be bytes (e.g. 2GiB, 512MiB, 1073741824) "
                         "or a fraction of free device memory in (0, 1]")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and "." in match.group(1):
        if not 0 < number <= 1:
            raise ValueError(f"kv cache memory fraction {spec!r} must be in (0, 1]")
        return int(number * free_device_memory(torch.device(device)))
    budget = int(number * _UNITS[unit])
    if budget <= 0:
        raise ValueError(f"kv cache memory {spec!r} must be positive")
    return budget


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")
