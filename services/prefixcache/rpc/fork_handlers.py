"""gRPC's fork handlers turned off, for processes that start services by fork and exec.

grpc reads `GRPC_ENABLE_FORK_SUPPORT` when it loads, so this must run before grpc is first imported.
"""
from __future__ import annotations

import os


def turn_off_grpc_fork_handlers() -> None:
    """Our launchers (serve, bench, the benchmarks, the e2e harness) fork only to exec a service,
    often while their own gRPC calls run. The handlers serve children that keep using gRPC; run in
    ours they could hang the child before exec, and otherwise only log that other threads use gRPC.
    A value already in the environment wins."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
