"""Regenerate the gRPC stubs after editing a .proto: `.venv/bin/python scripts/gen_protos.py`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PROTOS = Path(__file__).resolve().parent.parent / "protos"


def main() -> None:
    spec = importlib.util.spec_from_file_location("_codegen", PROTOS / "_codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    for path in codegen.generate(PROTOS):
        print(path.relative_to(PROTOS.parent))


if __name__ == "__main__":
    main()
