"""`prefixcache model pull|show`: pull converts the embedded model without torch (gguf, numpy and
safetensors do it); show checks a directory as the worker would, which takes torch."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.cli.main import main as cli_main
from prefixcache.model_store.store import is_complete_model_dir


def test_cli_pull_prints_the_model_directory(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["model", "pull"]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)


@pytest.mark.slow
def test_pull_converts_without_torch(tmp_path: Path) -> None:
    target = tmp_path / "converted"
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "prefixcache.cli.main", "model", "pull",
                             "--model-dir", str(target)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(target) and is_complete_model_dir(target)
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "gguf" in imported and not imported & {"torch", "triton", "transformers"}


def test_cli_show_describes_a_model_and_fails_without_one(model_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["model", "show", "--model-dir", str(model_dir)]) == 0
    shown = capsys.readouterr().out
    assert "LlamaForCausalLM" in shown and "9/3" in shown
    assert re.search(r"^model id +SmolLM2-135M-Instruct@sha256:[0-9a-f]{16}$", shown, re.MULTILINE), shown
    assert cli_main(["model", "show", "--model-dir", str(tmp_path)]) == 1
    assert "config.json is missing" in capsys.readouterr().err
    # A user's own directory that does not exist: no hint to pull the embedded model.
    assert cli_main(["model", "show", "--model-dir", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err.strip() == f"error: model directory {tmp_path / 'nowhere'} does not exist"


def test_cli_show_checks_a_model_as_the_services_would(model_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    weights_only = tmp_path / "weights-only"  # what the worker needs, without the tokenizer's file
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).symlink_to(model_dir / name)
    assert cli_main(["model", "show", "--model-dir", str(weights_only)]) == 1
    assert "no tokenizer.json" in capsys.readouterr().err
    truncated = tmp_path / "truncated"  # a download cut short
    truncated.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (truncated / name).symlink_to(model_dir / name)
    with open(model_dir / "model.safetensors", "rb") as weights:
        (truncated / "model.safetensors").write_bytes(weights.read(1 << 20))
    assert cli_main(["model", "show", "--model-dir", str(truncated)]) == 1
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().err
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert cli_main(["model", "show", "--model-dir", str(other)]) == 1
    assert "unsupported architecture ['GPT2LMHeadModel']" in capsys.readouterr().err
