"""A CUDA device the worker cannot use is one line naming the driver and torch's CUDA, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prefixcache.launcher import free_port
from prefixcache.worker.cuda_check import CudaSetup, cuda_problem

H100 = (9, 0)
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")  # a CUDA 13 build's list


def setup(torch_cuda: str | None = "13.0", driver_cuda: tuple[int, int] | None = (13, 0),
          capabilities: tuple[tuple[int, int], ...] = (H100,), driver: str | None = "580.65.06") -> CudaSetup:
    return CudaSetup("2.13.0", torch_cuda, driver_cuda, driver, capabilities, ARCHS)


def test_a_gpu_the_build_supports_on_a_new_enough_driver_is_fine():
    assert cuda_problem(setup(), "cuda") is None
    assert cuda_problem(setup(driver_cuda=(13, 2)), "cuda:0") is None
    assert cuda_problem(setup(torch_cuda="12.8", driver_cuda=(12, 2)), "cuda") is None  # minor-version compatible


def test_an_old_driver_is_named_with_the_cuda_torch_needs():
    problem = cuda_problem(setup(driver_cuda=(12, 8), driver="570.86.10"), "cuda")
    assert problem == (
        "--device cuda: the NVIDIA driver 570.86.10 runs CUDA up to 12.8, but torch 2.13.0 is built for CUDA 13.0, "
        "which needs NVIDIA driver 580 or newer: upgrade the node's driver, or use the worker image built for "
        "CUDA 12 (docs/gpu.md)")


def test_an_old_driver_whose_version_is_unknown_is_still_named_by_its_cuda():
    problem = cuda_problem(setup(driver_cuda=(12, 2), driver=None), "cuda")
    assert problem.startswith("--device cuda: the NVIDIA driver runs CUDA up to 12.2, but torch 2.13.0 is built for "
                              "CUDA 13.0, which needs NVIDIA driver 580 or newer")


def test_no_driver_and_a_cpu_build_say_so():
    assert "no NVIDIA driver found (torch 2.13.0 is built for CUDA 13.0, which needs NVIDIA driver 580 or newer)" \
        in cuda_problem(setup(driver_cuda=None, driver=None), "cuda")
    assert cuda_problem(setup(torch_cuda=None), "cuda").startswith(
        "--device cuda: torch 2.13.0 is a CPU build, without CUDA: run the worker image")


def test_a_gpu_index_beyond_those_visible_is_named():
    assert "torch sees only 1 GPU(s)" in cuda_problem(setup(), "cuda:1")
    assert "torch sees no GPU" in cuda_problem(setup(capabilities=()), "cuda")


@pytest.mark.parametrize(("capability", "runs"), [
    ((7, 0), False),  # Volta: CUDA 13 builds dropped it
    ((7, 5), True), ((8, 9), True),  # sm_86 code runs on 8.9
    ((12, 1), True),  # sm_120 code
    ((13, 0), True),  # no sm_13x code, but compute_120 PTX compiles for it
])
def test_a_gpu_architecture_outside_the_build_is_named(capability, runs):
    problem = cuda_problem(setup(capabilities=(capability,)), "cuda")
    assert (problem is None) == runs
    if not runs:
        assert "this GPU (compute capability 7.0) is not among those torch 2.13.0 (CUDA 13.0) is built for" in problem


def test_a_worker_asked_for_a_cuda_device_it_cannot_use_exits_with_one_line():
    """Here torch is a CPU build or sees no GPU (CUDA_VISIBLE_DEVICES is empty): either way, one line."""
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", "worker", "--device", "cuda", "--port", str(free_port())],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "ERROR" in lines[0] and "--device cuda: " in lines[0] and "Traceback" not in lines[0]
