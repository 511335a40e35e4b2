"""Whether this process can run the model on CUDA, said in one line when it cannot.

The CUDA build of torch is built for one CUDA major version (torch 2.13.0 on PyPI: CUDA 13.0), and
an NVIDIA driver runs the CUDA versions up to its own: CUDA 13 needs driver 580 or newer, CUDA 12
driver 525 or newer (NVIDIA's minor-version compatibility). On an older driver torch fails deep in
its first CUDA call; the worker checks first, and exits naming the driver and torch's CUDA instead.

`CudaSetup.probe()` reads what the machine has (the driver through `libcuda`, without torch);
`cuda_problem` is a pure function of it, so every case is testable on a machine without a GPU.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The oldest Linux driver branch that runs each CUDA major version (minor-version compatibility).
MIN_DRIVER_FOR_CUDA = {12: 525, 13: 580}
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")  # the kernel module's version, also in containers
GPU_IMAGES_DOC = "docs/gpu.md"


@dataclass(frozen=True)
class CudaSetup:
    torch_version: str  # torch.__version__
    torch_cuda: str | None  # torch.version.cuda: the CUDA torch was built for ("13.0"); None for a CPU build
    driver_cuda: tuple[int, int] | None  # the newest CUDA the driver runs (cuDriverGetVersion); None: no driver
    driver_version: str | None = None  # "570.86.10", when the kernel module says; only for the message
    # What torch sees, probed only once torch's CUDA and the driver's agree:
    capabilities: tuple[tuple[int, int], ...] = ()  # compute capability of each visible GPU
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): sm_90, compute_90, ...

    @classmethod
    def probe(cls) -> CudaSetup:
        setup = cls(torch.__version__, torch.version.cuda, _driver_cuda_version(), _driver_version())
        if _driver_problem(setup) is not None:
            return setup  # asking torch now would only repeat the driver's complaint, as a warning
        count = torch.cuda.device_count()
        return CudaSetup(setup.torch_version, setup.torch_cuda, setup.driver_cuda, setup.driver_version,
                         tuple(torch.cuda.get_device_capability(index) for index in range(count)),
                         tuple(torch.cuda.get_arch_list()))


def cuda_problem(setup: CudaSetup, device: torch.device | str) -> str | None:
    """Why `device` (a CUDA device) cannot run here, in one line; None when it can."""
    device = torch.device(device)
    problem = _driver_problem(setup)
    if problem is not None:
        return f"--device {device}: {problem}"
    index = device.index or 0
    if index >= len(setup.capabilities):
        seen = f"only {len(setup.capabilities)} GPU(s)" if setup.capabilities else "no GPU"
        return (f"--device {device}: the NVIDIA driver{_named(setup)} runs CUDA {_cuda_name(setup.driver_cuda)}, "
                f"but torch sees {seen} (is one allotted to this container, and CUDA_VISIBLE_DEVICES right?)")
    capability = setup.capabilities[index]
    if not _runs_on(capability, setup.arch_list):
        return (f"--device {device}: this GPU (compute capability {capability[0]}.{capability[1]}) is not among "
                f"those torch {setup.torch_version} (CUDA {setup.torch_cuda}) is built for "
                f"({', '.join(setup.arch_list)}); use a worker image built for an older CUDA ({GPU_IMAGES_DOC})")
    return None


def _driver_problem(setup: CudaSetup) -> str | None:
    if setup.torch_cuda is None:
        return (f"torch {setup.torch_version} is a CPU build, without CUDA: run the worker image "
                f"(the CUDA build of torch; {GPU_IMAGES_DOC}) or use --device cpu")
    cuda_major = int(setup.torch_cuda.split(".")[0])
    needs = f"torch {setup.torch_version} is built for CUDA {setup.torch_cuda}, which needs NVIDIA driver " \
            f"{MIN_DRIVER_FOR_CUDA.get(cuda_major, '?')} or newer"
    if setup.driver_cuda is None:
        return (f"no NVIDIA driver found ({needs}); on Kubernetes, give the worker a GPU (worker.gpus) on a node "
                "with the NVIDIA device plugin")
    if setup.driver_cuda[0] < cuda_major:
        return (f"the NVIDIA driver{_named(setup)} runs CUDA up to {_cuda_name(setup.driver_cuda)}, but {needs}: "
                f"upgrade the node's driver, or use the worker image built for CUDA {setup.driver_cuda[0]} "
                f"({GPU_IMAGES_DOC})")
    return None


def _runs_on(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """A GPU runs torch's kernels if they include code for its major version at or below its minor one
    (sm_XY), or PTX for an architecture at or below it (compute_XY, compiled when loaded)."""
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        if not number.isdigit():
            continue
        arch_major, arch_minor = divmod(int(number), 10)
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= capability:
            return True
    return False


def _named(setup: CudaSetup) -> str:
    return f" {setup.driver_version}" if setup.driver_version else ""


def _cuda_name(version: tuple[int, int] | None) -> str:
    return f"{version[0]}.{version[1]}" if version else "none"


def _driver_cuda_version() -> tuple[int, int] | None:
    """(major, minor) of the newest CUDA the installed driver runs, or None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return divmod(version.value // 10, 100)  # 12080 -> (12, 8)


def _driver_version() -> str | None:
    try:
        text = DRIVER_VERSION_FILE.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None
