"""A scripted Engine servicer served on a free loopback port, for tests of code that drives an Engine
API (the benchmark driver, the side-by-side runner) rather than of the engine itself."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc

from prefixcache.protos.engine.v1 import engine_pb2_grpc


@contextlib.contextmanager
def serving(servicer: engine_pb2_grpc.EngineServicer, max_workers: int = 32) -> Iterator[str]:
    """`servicer`'s target, served by a threaded gRPC server until the block ends."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
