"""TLS for every gRPC server and channel, from PEM files.

A server with `--tls-cert` and `--tls-key` serves TLS only; with `--tls-client-ca` as well, it
accepts only clients presenting a certificate that CA signed (mutual TLS): how a tokenizer or a
worker accepts calls from its scheduler alone, and how the Engine API can identify tenants by their
client certificates. The files are read again when they change (on the next handshake), so a
rotated certificate, such as a renewed Kubernetes Secret, is served without a restart.

A channel takes the CA that signed its server's certificate and, for mutual TLS, its own
certificate and key, read once when the client starts.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{what}: cannot read {path}: {error.strerror or error}") from None


def _signature(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int], ...]:
    """What changes when any of `paths` is replaced or rewritten (a Secret's symlink swap included)."""
    signature = []
    for path in paths:
        stat = os.stat(path)
        signature.append((stat.st_ino, stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key, and the CA its clients' certificates must chain to."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key, *([self.client_ca] if self.client_ca else []))

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that reload the files when they change. Raises ValueError for an
        unreadable file at start; later, a file that cannot be read keeps the last good ones."""
        configuration = self.configuration()  # first: an unreadable file is a ValueError naming its flag
        reloading = _ReloadingCertificate(self)
        return grpc.dynamic_ssl_server_credentials(configuration, reloading.fetch,
                                                   require_client_authentication=self.client_ca is not None)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        client_ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=client_ca)


class _ReloadingCertificate:
    """gRPC asks `fetch` before each handshake: a new configuration once the files changed, else None."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._signature = _signature(tls.paths)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            signature = _signature(self._tls.paths)
            if signature == self._signature:
                return None
            configuration = self._tls.configuration()
        except (OSError, ValueError) as error:
            log.warning("TLS files unreadable, serving the previous certificate: %s", error)
            return None
        self._signature = signature
        log.info("TLS certificate files changed: serving the new certificate")
        return configuration


@dataclass(frozen=True)
class ChannelTls:
    """The CA a server's certificate must chain to and, for mutual TLS, this client's own pair (PEM)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_files(cls, ca: Path, cert: Path | None = None, key: Path | None = None) -> ChannelTls:
        """Raises ValueError naming an unreadable file, or a certificate without its key."""
        if (cert is None) != (key is None):
            raise ValueError("a client certificate and its key go together")
        return cls(_read(ca, "CA certificate"), _read(cert, "client certificate") if cert else None,
                   _read(key, "client key") if key else None)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def add_server_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (default: plaintext)")
    group.add_argument("--tls-cert", type=Path, metavar="FILE", help="PEM certificate chain to serve (with --tls-key)")
    group.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", type=Path, metavar="FILE",
                       help="accept only clients whose certificate this CA signed (mutual TLS)")


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    """The server TLS the flags ask for; ValueError naming the flag for an incomplete set."""
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
