"""`prefixcache serve --demo`, the README's first command: three processes, two requests, a cache hit."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.services.cli.launcher import free_port

pytestmark = pytest.mark.slow


def test_serve_demo_shows_the_second_requests_cached_tokens(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.services.cli.main", "serve", "--demo", "--port", str(free_port()),
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
