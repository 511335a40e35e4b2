"""Every .proto compiles into importable stubs whose package and imports match the Python package."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import prefixcache.protos

PROTOS = Path(prefixcache.protos.__file__).parent
PROTO_FILES = sorted(PROTOS.rglob("*.proto"))


def module_name(proto: Path, suffix: str) -> str:
    relative = proto.relative_to(PROTOS).with_suffix("")
    return "prefixcache.protos." + ".".join(relative.parts) + suffix


def test_every_service_has_a_proto() -> None:
    names = {p.relative_to(PROTOS).as_posix() for p in PROTO_FILES}
    assert {"engine/v1/engine.proto", "tokenizer/v1/tokenizer.proto", "worker/v1/worker.proto"} <= names


@pytest.mark.parametrize("proto", PROTO_FILES, ids=lambda p: p.relative_to(PROTOS).as_posix())
def test_generated_modules_import(proto: Path) -> None:
    pb2 = importlib.import_module(module_name(proto, "_pb2"))
    importlib.import_module(module_name(proto, "_pb2_grpc"))
    descriptor = pb2.DESCRIPTOR
    # The file is known to protobuf under its package-mirroring virtual path, and its proto package
    # is the versioned `prefixcache.<service>.v1`.
    assert descriptor.name == "prefixcache/protos/" + proto.relative_to(PROTOS).as_posix()
    service_dir = proto.relative_to(PROTOS).parts[0]
    assert descriptor.package == f"prefixcache.{service_dir}.v1"


@pytest.mark.parametrize(
    ("module", "service"),
    [("engine.v1.engine", "Engine"), ("tokenizer.v1.tokenizer", "Tokenizer"), ("worker.v1.worker", "Worker")],
)
def test_services_have_stubs_and_servicers(module: str, service: str) -> None:
    grpc_module = importlib.import_module(f"prefixcache.protos.{module}_pb2_grpc")
    assert hasattr(grpc_module, f"{service}Stub")
    assert hasattr(grpc_module, f"{service}Servicer")
    pb2 = importlib.import_module(f"prefixcache.protos.{module}_pb2")
    assert pb2.DESCRIPTOR.services_by_name[service].methods


def test_generate_request_round_trips() -> None:
    from prefixcache.protos.common.v1 import chat_pb2
    from prefixcache.protos.engine.v1 import engine_pb2

    request = engine_pb2.GenerateRequest(
        request_id="r1",
        chat=chat_pb2.ChatConversation(messages=[chat_pb2.ChatMessage(role="user", content="hi")]),
        sampling=engine_pb2.SamplingOptions(max_tokens=0, temperature=0.0, stop=["\n"]),
        tenant="acme",
    )
    decoded = engine_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.WhichOneof("prompt") == "chat"
    assert decoded.WhichOneof("isolation") == "tenant"
    # explicit zeros stay distinguishable from unset, so the server can reject max_tokens=0
    assert decoded.sampling.HasField("max_tokens") and not decoded.sampling.HasField("top_p")
