"""Package layout: the `prefixcache` namespace maps onto the fixed top-level folders."""
from setuptools import find_packages, setup

FOLDERS = {"services": "services", "kernels": "kernels", "operator": "operator", "protos": "protos"}


def packages_and_dirs() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in FOLDERS.items():
        root = f"prefixcache.{name}"
        packages.append(root)
        package_dir[root] = folder
        for sub in find_packages(folder):
            packages.append(f"{root}.{sub}")
    return packages, package_dir


packages, package_dir = packages_and_dirs()
setup(packages=packages, package_dir=package_dir)
