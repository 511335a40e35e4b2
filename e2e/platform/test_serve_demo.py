"""`prefixcache serve --demo`, the README's first command: three processes, two requests, a cache hit."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from platform_harness import run

from prefixcache.client import EngineClient
from prefixcache.launcher import free_port

pytestmark = pytest.mark.slow


def test_serve_demo_shows_the_second_requests_cached_tokens(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", "serve", "--demo", "--port", str(free_port()),
         "--kv-cache-memory", "64MiB", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    prompts = [int(n) for n in re.findall(r"prompt (\d+) tokens", result.stdout)]
    cached = [int(n) for n in re.findall(r"cached (\d+)", result.stdout)]
    assert len(prompts) == 2 and cached[0] == 0
    # The shared system prompt is most of the second prompt; all its full blocks are hits.
    assert cached[1] % 16 == 0 and cached[1] > 0.9 * prompts[1]
    assert result.stdout.rstrip().endswith(f"the second request's cached tokens: {cached[1]}")
    assert result.stderr == ""  # every service exited 0 after the demo


def test_sigterm_to_serve_past_the_grace_aborts_cleanly_and_exits_0(tmp_path: Path) -> None:
    """A request that outlasts the grace period is aborted with a final message, and every service
    still exits 0: the launcher gives each one its grace plus a margin before killing it."""
    port = free_port()
    serve = _serve(port, tmp_path, "--grace", "2", "--kv-cache-memory", "256MiB")
    try:
        assert "Engine API serving" in _line_containing(serve.stdout, "Engine API serving", timeout_s=300)
        generate = _generate_in_background(port, max_tokens=3000)
        _wait_until_running(port)
        time.sleep(4)  # well into the stream (the model writes ~20 tokens a second here)
        serve.send_signal(signal.SIGTERM)
        out, err = generate.communicate(timeout=120)
        assert serve.wait(timeout=60) == 0, serve.stderr.read()
    finally:
        serve.kill()
    completion = json.loads(out)
    assert completion["finish_reason"] == "abort", err
    assert 0 < completion["usage"]["completion_tokens"] < 3000
    assert serve.stderr.read() == ""  # no service exited with an error


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)], ids=["sigterm", "ctrl-c-twice"])
def test_stopping_the_whole_process_group_still_lets_in_flight_requests_finish(tmp_path: Path, signals) -> None:
    """systemd (KillMode=control-group) and `kill -- -PGID` send SIGTERM to every process at once:
    the worker and the tokenizer keep serving the draining scheduler until it is done. A terminal's
    Ctrl-C reaches the whole group too, and an impatient second one must not cut the stop short."""
    port = free_port()
    serve = _serve(port, tmp_path, "--grace", "60", "--kv-cache-memory", "256MiB", new_session=True)
    try:
        assert "Engine API serving" in _line_containing(serve.stdout, "Engine API serving", timeout_s=300)
        generate = _generate_in_background(port, max_tokens=40)
        _wait_until_running(port)  # admitted and streaming, far from done
        for signum in signals:
            os.killpg(serve.pid, signum)
            time.sleep(1)
        out, err = generate.communicate(timeout=120)
        assert serve.wait(timeout=120) == 0, serve.stderr.read()
        assert _session_processes(serve.pid) == []  # no service outlived serve
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)
    assert generate.returncode == 0, err
    completion = json.loads(out)
    assert (completion["finish_reason"], completion["usage"]["completion_tokens"]) == ("length", 40)
    assert serve.stderr.read() == ""


def test_ctrl_c_during_startup_stops_serve_without_waiting_for_the_model(tmp_path: Path) -> None:
    serve = _serve(free_port(), tmp_path, new_session=True)
    try:
        assert "starting" in serve.stdout.readline()
        time.sleep(1.0)  # the worker is still loading its model
        os.killpg(serve.pid, signal.SIGINT)
        out, err = serve.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)
    assert serve.returncode == 0, err
    assert "Engine API serving" not in out and out.strip().endswith("stopping")
    assert _session_processes(serve.pid) == []


def _serve(port: int, log_dir: Path, *options: str, new_session: bool = False) -> subprocess.Popen:
    """`prefixcache serve` as a user starts it; `new_session`: in a process group of its own, for
    signals sent to the whole group as a terminal or systemd does."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli.main", "serve", "--port", str(port), "--log-dir", str(log_dir),
         *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session,
    )  # fmt: skip


def _generate_in_background(port: int, max_tokens: int) -> subprocess.Popen:
    """A greedy generation that ignores end-of-sequence, printing one JSON object at the end."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli.main", "generate", "--target", f"127.0.0.1:{port}",
         "--json", "--max-tokens", str(max_tokens), "--ignore-eos", "--temperature", "0", "Count to a million."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_until_running(port: int, timeout_s: float = 120) -> None:
    """Until the engine runs a request. (A fixed sleep could end, on a loaded machine, before the
    client process has even sent it; a stop signal then refuses it instead of letting it finish.)"""
    async def main() -> None:
        deadline = time.monotonic() + timeout_s
        async with EngineClient(f"127.0.0.1:{port}") as engine:
            while (await engine.cache_stats()).running_requests == 0:
                assert time.monotonic() < deadline, "the request never started running"
                await asyncio.sleep(0.05)

    run(main())


def _session_processes(session_id: int) -> list[str]:
    """Processes still alive in the session `serve` led (its services, unless they have exited)."""
    result = subprocess.run(["pgrep", "-a", "-s", str(session_id)], capture_output=True, text=True)
    return result.stdout.splitlines()


def _line_containing(stream, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    for line in stream:
        if text in line or time.monotonic() > deadline:
            return line
    return ""
