"""TLS from PEM files (certificates made by `trustme` for each test): a TLS server serves nothing in
plaintext, a mutual-TLS server only clients holding a certificate of its CA, and a rotated
certificate is served from the next handshake without a restart."""
from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import pytest
import trustme
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from prefixcache.rpc.client import is_serving, open_channel
from prefixcache.rpc.tls import ChannelTls, ServerTls, add_server_tls_arguments, server_tls


def write_pair(ca: trustme.CA, directory: Path, name: str, *identities: str) -> tuple[Path, Path]:
    """A certificate of `ca` for `identities` and its key, written as PEM files (replaced atomically)."""
    issued = ca.issue_cert(*identities)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    for path, blob in ((cert, issued.cert_chain_pems[0]), (key, issued.private_key_pem)):
        staged = path.with_suffix(".new")
        blob.write_to_path(str(staged))
        os.replace(staged, path)
    return cert, key


def write_ca(ca: trustme.CA, path: Path) -> Path:
    ca.cert_pem.write_to_path(str(path))
    return path


async def serving(tls: ServerTls):
    server = aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_secure_port("127.0.0.1:0", tls.credentials())
    await server.start()
    return server, f"127.0.0.1:{port}"


async def answers(target: str, tls: ChannelTls | None) -> bool:
    async with open_channel(target, tls) as channel:
        return await is_serving(channel, timeout_s=3)


def test_a_tls_server_refuses_plaintext_and_serves_a_rotated_certificate(tmp_path: Path) -> None:
    old_ca, new_ca = trustme.CA(), trustme.CA()
    cert, key = write_pair(old_ca, tmp_path, "server", "127.0.0.1")

    async def main() -> None:
        server, target = await serving(ServerTls(cert, key))
        try:
            assert await answers(target, ChannelTls.from_files(write_ca(old_ca, tmp_path / "old.pem")))
            assert not await answers(target, None)  # plaintext gets nothing, not even health
            assert not await answers(target, ChannelTls.from_files(write_ca(new_ca, tmp_path / "new.pem")))
            write_pair(new_ca, tmp_path, "server", "127.0.0.1")  # rotated, as a renewed Secret would be
            assert await answers(target, ChannelTls.from_files(tmp_path / "new.pem"))
            assert not await answers(target, ChannelTls.from_files(tmp_path / "old.pem"))
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(tmp_path: Path) -> None:
    service_ca, scheduler_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    cert, key = write_pair(service_ca, tmp_path / "server", "tokenizer", "127.0.0.1")
    ours = write_pair(scheduler_ca, tmp_path / "ours", "scheduler", "scheduler.example")
    theirs = write_pair(stranger_ca, tmp_path / "theirs", "mallory", "scheduler.example")
    trusted = write_ca(service_ca, tmp_path / "service-ca.pem")

    async def main() -> None:
        server, target = await serving(ServerTls(cert, key, client_ca=write_ca(scheduler_ca, tmp_path / "clients.pem")))
        try:
            assert await answers(target, ChannelTls.from_files(trusted, *ours))
            assert not await answers(target, ChannelTls.from_files(trusted))  # no client certificate
            assert not await answers(target, ChannelTls.from_files(trusted, *theirs))  # another CA's, same name
            assert not await answers(target, None)
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_peer_name_reaches_the_servicer_from_a_verified_certificate_only(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = write_pair(ca, tmp_path / "server", "engine", "127.0.0.1")
    client = write_pair(ca, tmp_path / "client", "acme", "acme.clients.example")
    seen: list[list[bytes] | None] = []

    class Recording(health_aio.HealthServicer):
        async def Check(self, request, context):
            seen.append(context.peer_identities())
            return await super().Check(request, context)

    async def main() -> None:
        server = aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Recording(), server)
        port = server.add_secure_port("127.0.0.1:0", ServerTls(cert, key, write_ca(ca, tmp_path / "ca.pem")).credentials())
        await server.start()
        try:
            async with open_channel(f"127.0.0.1:{port}", ChannelTls.from_files(tmp_path / "ca.pem", *client)) as channel:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert seen == [[b"acme.clients.example"]]


@pytest.mark.parametrize("flags, problem", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
])
def test_incomplete_tls_flags_are_refused(flags: list[str], problem: str) -> None:
    parser = argparse.ArgumentParser()
    add_server_tls_arguments(parser)
    with pytest.raises(ValueError, match=problem):
        server_tls(parser.parse_args(flags))


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-key: cannot read"):
        ServerTls(tmp_path / "missing.crt", tmp_path / "missing.key").credentials()
    with pytest.raises(ValueError, match="CA certificate: cannot read"):
        ChannelTls.from_files(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="go together"):
        ChannelTls.from_files(tmp_path / "ca.pem", cert=tmp_path / "c.pem")
