"""A private local platform for the benchmark: `prefixcache serve` in a child process.

Running the real `serve` command (rather than a second launcher) means the benchmark measures
exactly what users run; extra `serve` flags pass through unchanged.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from prefixcache.services.common.grpc_client import wait_until_serving


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalPlatform:
    """`async with LocalPlatform(args) as target:` serves on a free loopback port until the block ends."""

    def __init__(self, serve_args: Sequence[str] = (), startup_timeout_s: float = 600.0, stop_grace_s: float = 30.0):
        self._serve_args = list(serve_args)
        self._startup_timeout_s = startup_timeout_s
        self._stop_grace_s = stop_grace_s
        self._process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="prefixcache-bench-serve-", suffix=".log", delete=False)

    async def __aenter__(self) -> str:
        port = free_port()
        target = f"127.0.0.1:{port}"
        command = [sys.executable, "-m", "prefixcache.services.cli.main", "serve", "--port", str(port), *self._serve_args]
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            await self._wait_ready(target)
        except (RuntimeError, TimeoutError) as error:
            tail = self.log_tail()
            await self.__aexit__()
            raise RuntimeError(f"local `prefixcache serve` failed: {error}\n{tail}") from None
        return target

    async def _wait_ready(self, target: str) -> None:
        waiting = asyncio.create_task(wait_until_serving(target, self._startup_timeout_s))
        while not waiting.done():
            if self._process.poll() is not None:
                waiting.cancel()
                raise RuntimeError(f"it exited with status {self._process.returncode}")
            await asyncio.sleep(0.2)
        waiting.result()

    async def __aexit__(self, *exc_info: object) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, self._stop_grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
        if process is not None:
            # serve ran in its own session: take down any service it left behind.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        self._log.close()
        os.unlink(self._log.name)

    def log_tail(self, lines: int = 30) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as log:
            return "".join(log.readlines()[-lines:])
