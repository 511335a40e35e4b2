"""The import contracts in pyproject.toml hold, checked by import-linter run directly.

The four source roots are plain entries on the virtual environment's path (`scripts/setup.sh`), so
`lint-imports` resolves every `prefixcache.*` import to its file without any help from setuptools.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
needs_import_linter = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (pip install -e .[test])")


def run_lint_imports(config: Path, cwd: Path, python_path: str | None = None) -> subprocess.CompletedProcess:
    env = None if python_path is None else {"PYTHONPATH": python_path, "PATH": ""}
    return subprocess.run([LINT_IMPORTS, "--config", str(config), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@needs_import_linter
def test_import_contracts_are_kept():
    result = run_lint_imports(ROOT / "pyproject.toml", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    for contract in ("The house reads top to bottom", "cache code and block identity import no torch",
                     "control plane imports no torch", "operator imports no model"):
        assert contract in result.stdout
    assert "BROKEN" not in result.stdout


@needs_import_linter
def test_an_upward_import_breaks_the_layers(tmp_path: Path):
    """The same kind of contract on a throwaway namespace fails when a lower layer imports a higher one."""
    for layer, body in (("cli", ""), ("scheduler", "import layeringprobe.cli\n")):
        package = tmp_path / "root" / "layeringprobe" / layer
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(body)
    config = tmp_path / "pyproject.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["layeringprobe"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "probe"\ntype = "layers"\n'
        'layers = ["layeringprobe.cli", "layeringprobe.scheduler"]\n'
    )
    result = run_lint_imports(config, tmp_path, python_path=str(tmp_path / "root"))
    assert result.returncode != 0
    assert "probe BROKEN" in result.stdout
    assert "layeringprobe.scheduler is not allowed to import layeringprobe.cli" in result.stdout


def test_nothing_at_the_repository_root_shadows_the_standard_library():
    """From the root, `import operator` is the standard library's, with site-packages or without."""
    for flags in ((), ("-S",)):
        result = subprocess.run([sys.executable, *flags, "-c", "import operator; print(operator.__file__)"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert not result.stdout.startswith(str(ROOT)), result.stdout
