"""Fixtures of the CPU kernel tests (the Triton setup and `paged_batch` come from `tests/kernels/conftest.py`)."""

from __future__ import annotations

import pytest

from prefixcache.kernels.cpu.native import NativeCpuKernels, native_cpu_kernels


@pytest.fixture(scope="session")
def kernels() -> NativeCpuKernels:
    """The native CPU kernels, for test modules skipped without AVX-512: on a CPU that has it, a
    kernel that fails to build fails the test rather than hiding behind torch's fallback."""
    built = native_cpu_kernels()
    assert built is not None, "the native kernels did not build on a CPU that runs them (see the log)"
    return built
