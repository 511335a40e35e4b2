"""Package layout: the `prefixcache` namespace maps onto the fixed top-level folders.

`build_py` also compiles `protos/**/*.proto` into Python gRPC stubs written next to them (they are
gitignored), so every install, editable ones included, carries stubs matching its .proto files.
"""
import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

FOLDERS = {"services": "services", "kernels": "kernels", "operator": "operator", "protos": "protos"}
# Folders that hold only package data (no Python), named so that setuptools ships them as such.
DATA_PACKAGES = ["prefixcache.kernels.cpu"]  # the native CPU kernels' C++ sources, built on first use
ROOT = Path(__file__).resolve().parent


def packages_and_dirs() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in FOLDERS.items():
        root = f"prefixcache.{name}"
        packages.append(root)
        package_dir[root] = folder
        for sub in find_packages(folder):
            packages.append(f"{root}.{sub}")
    return packages + DATA_PACKAGES, package_dir


def generate_protos() -> None:
    spec = importlib.util.spec_from_file_location("_codegen", ROOT / "protos" / "_codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    codegen.generate(ROOT / "protos")


class BuildPyWithProtos(build_py):
    """Generates the gRPC stubs before collecting the modules to install."""

    def run(self) -> None:
        generate_protos()
        super().run()


packages, package_dir = packages_and_dirs()
setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_py": BuildPyWithProtos},
)
