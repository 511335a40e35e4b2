"""The three services as separate local processes on loopback: what `serve` and the e2e tests run.

Each service is `python -m prefixcache.cli.main <service> ...` with its own log file. The
tokenizer and worker take free loopback ports; the scheduler (the Engine API) takes the port given.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefixcache.rpc.client import wait_until_serving
from prefixcache.rpc.tls import ChannelTls

LOOPBACK = "127.0.0.1"
# Each service bounds its own shutdown by the grace it was given, then needs a little more to close
# aborted streams (their final message) and its server: only this much later is it killed.
SHUTDOWN_MARGIN_S = 10.0
DRAIN_IDLE_S = 1.0  # how long the worker and tokenizer wait for the scheduler's next call when stopping


def free_port() -> int:
    """A port nothing listens on right now (the usual small race with other processes applies)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    address: str  # HOST:PORT clients use
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    tls: ChannelTls | None = None  # how clients reach it, when it serves TLS
    process: subprocess.Popen | None = None
    log_start: int = 0  # where this run's lines begin: a reused log directory keeps earlier runs'

    def start(self) -> None:
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prefixcache.cli.main", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                # Ctrl-C reaches the terminal's whole process group at once; the services ignore it
                # and are stopped in order by `LocalPlatform.stop` (the scheduler drains first,
                # while the worker still runs). They stay in the group, so a group kill reaches them.
                preexec_fn=_ignore_sigint,
            )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running:
            self.process.kill()
            self.process.wait()

    def wait(self, timeout_s: float) -> int | None:
        """Exit status, killing the process if it is still running after `timeout_s`."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode

    def log_tail(self, lines: int = 20) -> str:
        """The last lines this run wrote."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class PlatformConfig:
    model_dir: Path
    log_dir: Path
    engine_port: int = 50051
    engine_host: str = "localhost"
    dtype: str = "auto"  # the worker's: bfloat16 on a GPU that has it, else float32
    kv_cache_memory: str = "1GiB"
    scheduler_args: list[str] = field(default_factory=list)  # extra flags, e.g. ["--no-prefix-caching"]
    worker_args: list[str] = field(default_factory=list)
    tokenizer_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # for every service, e.g. OTEL_* variables
    grace_s: float = 15.0  # the scheduler's to finish in-flight requests on SIGTERM
    tokenizer_args: list[str] = field(default_factory=list)
    # How to reach each service (by name) that its args make serve TLS: its readiness is checked so.
    service_tls: dict[str, ChannelTls] = field(default_factory=dict)

    @property
    def draining_grace_s(self) -> float:
        """The worker's and the tokenizer's grace: the scheduler's, their wait for it to go quiet, a second."""
        return self.grace_s + DRAIN_IDLE_S + 1


class LocalPlatform:
    """Tokenizer, worker and scheduler processes. Use `start()`, `wait_ready()`, `stop()`."""

    def __init__(self, config: PlatformConfig):
        self.config = config
        config.log_dir.mkdir(parents=True, exist_ok=True)
        tokenizer_port, worker_port = free_port(), free_port()
        model = ["--model-dir", str(config.model_dir)]
        # The scheduler is the only caller of both: if they get SIGTERM with it (a process group or a
        # cgroup signalled as a whole), they serve it until it has drained.
        draining = ["--drain-idle", str(DRAIN_IDLE_S), "--grace", str(config.draining_grace_s)]
        self.tokenizer = ServiceProcess(
            "tokenizer",
            ["tokenizer", "--host", LOOPBACK, "--port", str(tokenizer_port), *model, *draining, *config.tokenizer_args],
            f"{LOOPBACK}:{tokenizer_port}",
            config.log_dir / "tokenizer.log",
            config.env,
            tls=config.service_tls.get("tokenizer"),
        )
        self.worker = ServiceProcess(
            "worker",
            [
                "worker", "--host", LOOPBACK, "--port", str(worker_port), *model, *draining,
                "--dtype", config.dtype, "--kv-cache-memory", config.kv_cache_memory, *config.worker_args,
            ],  # fmt: skip
            f"{LOOPBACK}:{worker_port}",
            config.log_dir / "worker.log",
            config.env,
            tls=config.service_tls.get("worker"),
        )
        self.scheduler = ServiceProcess(
            "scheduler",
            [
                "scheduler", "--host", config.engine_host, "--port", str(config.engine_port),
                "--tokenizer", self.tokenizer.address, "--worker", self.worker.address,
                "--grace", str(config.grace_s), *config.scheduler_args,
            ],  # fmt: skip
            f"{_client_host(config.engine_host)}:{config.engine_port}",
            config.log_dir / "scheduler.log",
            config.env,
            tls=config.service_tls.get("scheduler"),
        )

    @property
    def services(self) -> tuple[ServiceProcess, ...]:
        return (self.tokenizer, self.worker, self.scheduler)

    @property
    def engine_address(self) -> str:
        return self.scheduler.address

    def start(self) -> None:
        for service in self.services:
            service.start()

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until every service reports SERVING; RuntimeError naming the service that exited or did
        not get there in time, with the end of its log."""
        deadline = time.monotonic() + timeout_s
        for service in self.services:
            await self.wait_serving(service, max(1.0, deadline - time.monotonic()))

    async def wait_serving(self, service: ServiceProcess, timeout_s: float) -> None:
        waiting = asyncio.ensure_future(wait_until_serving(service.address, timeout_s, tls=service.tls))
        try:
            while not waiting.done():
                if not service.running:
                    raise RuntimeError(
                        f"the {service.name} exited with status {service.process.returncode}:\n{service.log_tail()}"
                    )
                await asyncio.sleep(0.1)
            waiting.result()
        except TimeoutError:
            raise RuntimeError(
                f"the {service.name} was not serving after {timeout_s:.0f} s; its log ends:\n{service.log_tail()}"
            ) from None
        finally:
            waiting.cancel()

    def exited(self) -> ServiceProcess | None:
        """A service that is no longer running, if any."""
        return next((s for s in self.services if not s.running), None)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM the scheduler first (it drains within its grace), then the others; exit status per
        service. A service still running `SHUTDOWN_MARGIN_S` after its grace is killed (status -9)."""
        statuses = {}
        timeout_s = self.config.draining_grace_s + SHUTDOWN_MARGIN_S
        self.scheduler.terminate()
        statuses["scheduler"] = self.scheduler.wait(timeout_s)
        for service in (self.worker, self.tokenizer):
            service.terminate()
        for service in (self.worker, self.tokenizer):
            statuses[service.name] = service.wait(timeout_s)
        return statuses


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _client_host(bind_host: str) -> str:
    """Where a local client reaches a server bound to `bind_host`."""
    return LOOPBACK if bind_host in ("localhost", "[::]", "0.0.0.0") else bind_host


def default_log_dir() -> Path:
    from prefixcache.model_store.store import model_home

    return model_home() / "logs" / f"serve-{os.getpid()}"
