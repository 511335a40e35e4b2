"""How long the worker's OpenMP threads spin between steps before they sleep.

torch's CPU kernels run on an OpenMP team (libgomp in the PyPI builds). Once a parallel region ends,
its threads spin for GOMP_SPINCOUNT iterations waiting for the next one, then sleep on a futex.
Between two steps the worker is idle for the scheduler's turn: the reply, output processing,
streaming to clients and the next step's gRPC call, 5 to 13 ms on the 2-core dev VM with the other
services and the clients sharing its cores. With libgomp's default, 300,000 spins (about 14 ms in an
idle process there), every decode step took longer under that load; longer spinning keeps the team
awake from one step to the next. (Why the default falls short there, whether the threads' wake-up
or spins slowed by the other processes, was not isolated.)

Measured on that VM (2026-12-05, Intel Xeon, `prefixcache bench --workload shared-system-prompt
--num-requests 8 --concurrency 8 --prefix-len 1024 --suffix-len 50:50 --output-len 32` against
`prefixcache serve`), ITL p50 / requests/s:
default 82-101 ms / 1.50-1.71 over eight runs; 1,000,000 spins 72-74 ms / 1.78-1.83 over two;
3,000,000 spins 70-76 ms / 1.75-1.93 over four; OMP_WAIT_POLICY=active (never sleep) 72 ms /
1.85-1.95 over two. 3,000,000 spins last about 50 ms in an idle process: an idle worker's threads
sleep after that, where OMP_WAIT_POLICY=active would keep a core busy for minutes.

libgomp reads the variable once, when torch loads it, so this must run before `import torch`.
A value set by the operator (the pod's environment) wins. Builds on Intel's OpenMP runtime ignore
it (their analogue, KMP_BLOCKTIME, was not measured, so it is left alone).
"""
from __future__ import annotations

import os
import sys

GOMP_SPINCOUNT = "3000000"


def configure_openmp_wait() -> bool:
    """Set GOMP_SPINCOUNT for this process unless already set. Returns False where it is too late to
    matter (torch is already imported)."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    return True
