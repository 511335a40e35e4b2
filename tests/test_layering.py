"""Layering: the scheduler's cache code and block identity import no torch, triton or grpc.

`lint-imports` reads the contracts in pyproject.toml. The editable install maps the
`prefixcache` namespace onto the top-level folders through an import hook that import-linter
cannot follow, so the test lays out a real `prefixcache/` directory of symlinks for it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("services", "kernels", "operator", "protos")
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


def run_lint_imports(python_path: Path, config: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(python_path))
    return subprocess.run([LINT_IMPORTS, "--config", str(config), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def namespace_root(tmp_path: Path) -> Path:
    package = tmp_path / "prefixcache"
    package.mkdir()
    for folder in FOLDERS:
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    return tmp_path


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (pip install -e .[test])")
def test_import_contracts_are_kept(namespace_root: Path):
    result = run_lint_imports(namespace_root, ROOT / "pyproject.toml", namespace_root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "scheduler's cache code imports no torch, triton or grpc KEPT" in result.stdout


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (pip install -e .[test])")
def test_a_forbidden_import_breaks_the_contract(tmp_path: Path):
    """The same kind of contract on a throwaway package fails when its cache module imports grpc."""
    package = tmp_path / "layeringprobe"
    (package / "kv_cache").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "kv_cache" / "__init__.py").write_text("import grpc\n")
    config = tmp_path / "pyproject.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["layeringprobe"]\ninclude_external_packages = true\n\n'
        '[[tool.importlinter.contracts]]\nname = "probe"\ntype = "forbidden"\n'
        'source_modules = ["layeringprobe.kv_cache"]\nforbidden_modules = ["torch", "triton", "grpc"]\n'
    )
    result = run_lint_imports(tmp_path, config, tmp_path)
    assert result.returncode != 0
    assert "probe BROKEN" in result.stdout
