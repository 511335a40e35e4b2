"""Generate the Python gRPC stubs next to the `.proto` files.

The proto tree mirrors the Python package (`protos/prefixcache/protos/engine/v1/engine.proto` is the
module `prefixcache.protos.engine.v1`), so with `protos/` as the include root protoc emits absolute
imports such as `from prefixcache.protos.common.v1 import chat_pb2` that work unmodified, and writes
each stub beside its `.proto`.

Used by the `build_py` hook in setup.py and by `scripts/gen_protos.py`. Imports nothing from
`prefixcache`, so it runs before the package is installed.
"""
from __future__ import annotations

from pathlib import Path

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(protos_dir: Path) -> list[Path]:
    return sorted(protos_dir.rglob("*.proto"))


def generate(protos_dir: Path) -> list[Path]:
    """Compile every .proto under `protos_dir`; return the generated files (written in place)."""
    from grpc_tools import protoc  # a build requirement, imported only when generating

    protos_dir = protos_dir.resolve()
    sources = proto_files(protos_dir)
    if not sources:
        return []
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{protos_dir}",
        f"-I{well_known}",
        f"--python_out={protos_dir}",
        f"--pyi_out={protos_dir}",
        f"--grpc_python_out={protos_dir}",
        *(str(source) for source in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos_dir} (see its message above)")
    return sorted(path for path in protos_dir.rglob("*") if path.name.endswith(GENERATED_SUFFIXES))
