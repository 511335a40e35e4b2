"""How long the worker's OpenMP threads spin between steps before they sleep.

torch's CPU kernels run on an OpenMP team (libgomp in the PyPI builds). Once a parallel region ends,
its threads spin for GOMP_SPINCOUNT iterations waiting for the next one, then sleep on a futex.
Between two steps the worker is idle for the scheduler's turn: the reply, output processing,
streaming to clients and the next step's gRPC call, several milliseconds when the other services and
the clients share the worker's cores. With libgomp's default of 300,000 spins, which can run out
within that gap, every decode step took longer under such load. (Why the default falls short there,
whether the threads' wake-up or spins slowed by the other processes, was not isolated.) Spinning
longer keeps the team awake from one step to the next: at 3,000,000 spins the inter-token latency
and throughput under load match never sleeping (OMP_WAIT_POLICY=active), yet an idle worker's
threads still sleep after a fraction of a second, where OMP_WAIT_POLICY=active would keep a core
busy for as long as the worker idles.

libgomp reads the variable once, when torch loads it, so this must run before `import torch`.
A value set by the operator (the pod's environment) wins. Builds on Intel's OpenMP runtime ignore
it; their analogue, KMP_BLOCKTIME, is left alone, as it was not measured.
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
