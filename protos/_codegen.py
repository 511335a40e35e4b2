"""Generate the Python gRPC stubs next to the `.proto` files.

The proto tree mirrors the Python package: `protos/engine/v1/engine.proto` is compiled with the
include mapping `prefixcache/protos=protos`, so protoc sees it as
`prefixcache/protos/engine/v1/engine.proto` and emits absolute imports such as
`from prefixcache.protos.common.v1 import chat_pb2` that work unmodified. protoc writes under
`<out>/prefixcache/protos/...`; the files are then moved next to their `.proto`.

Used by the `build_py` hook in setup.py and by `scripts/gen_protos.py`. Imports nothing from
`prefixcache`, so it runs before the package is installed.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

VIRTUAL_ROOT = Path("prefixcache/protos")
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
    include = f"-I{VIRTUAL_ROOT.as_posix()}={protos_dir}"
    well_known = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "grpc_tools.protoc",
            include,
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *(str(source) for source in sources),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos_dir} (see its message above)")
        written = []
        generated_root = Path(out) / VIRTUAL_ROOT
        for produced in sorted(generated_root.rglob("*")):
            if produced.is_file() and produced.name.endswith(GENERATED_SUFFIXES):
                target = protos_dir / produced.relative_to(generated_root)
                shutil.copyfile(produced, target)
                written.append(target)
    return written
