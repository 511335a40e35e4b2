"""The worker sets OpenMP's spin count before torch loads, unless the operator set one."""
from __future__ import annotations

import os
import subprocess
import sys

from prefixcache.worker.openmp_wait import GOMP_SPINCOUNT


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"} | env
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def _python(code: str, **env: str) -> str:
    return _run_python(code, **env).stdout.strip()


def test_set_before_torch_is_imported() -> None:
    out = _python(
        "import os\n"
        "from prefixcache.worker.openmp_wait import configure_openmp_wait\n"
        "print(configure_openmp_wait(), os.environ['GOMP_SPINCOUNT'])\n"
    )
    assert out == f"True {GOMP_SPINCOUNT}"


def test_the_operators_value_wins() -> None:
    out = _python(
        "import os\n"
        "from prefixcache.worker.openmp_wait import configure_openmp_wait\n"
        "print(configure_openmp_wait(), os.environ['GOMP_SPINCOUNT'])\n",
        GOMP_SPINCOUNT="12345",
    )
    assert out == "True 12345"


def test_too_late_once_torch_is_imported() -> None:
    out = _python(
        "import os, torch\n"
        "from prefixcache.worker.openmp_wait import configure_openmp_wait\n"
        "print(configure_openmp_wait(), os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    assert out == "False None"


def test_the_worker_command_sets_it_first() -> None:
    # A bad --kv-cache-memory makes `run` return before loading anything: what it set by then is
    # what the model load would see.
    done = _run_python(
        "import os\n"
        "from prefixcache.cli.main import build_parser\n"
        "args = build_parser(['worker']).parse_args(['worker', '--kv-cache-memory', 'lots'])\n"
        "print(args.run(args), os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    assert done.stdout.strip() == f"2 {GOMP_SPINCOUNT}"
    assert "--kv-cache-memory" in done.stderr  # it got as far as the argument check
    assert "GOMP_SPINCOUNT" not in done.stderr  # and torch was not loaded before the spin count was set
