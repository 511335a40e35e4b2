"""Options and error reporting shared by the client subcommands (generate, chat, stats, events, diagnose)."""
from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from prefixcache.arg_types import bounded_float, bounded_int, engine_target, non_empty, utf8_text
from prefixcache.cli.salt_env import API_KEY_ENV, CACHE_SALT_ENV, api_key, cache_salt
from prefixcache.client import DEFAULT_TARGET, EngineClient
from prefixcache.rpc.tls import ChannelTls

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=engine_target, default=DEFAULT_TARGET, metavar="HOST:PORT", help=f"Engine API (default {DEFAULT_TARGET})")
    parser.add_argument("--api-key-file", type=Path, metavar="FILE",
                        help=f"the tenant's (or an admin's) API key (default: ${API_KEY_ENV}; never on the command line, "
                             "where other users' `ps` would see it)")
    parser.add_argument("--tls-ca", type=Path, metavar="FILE", help="connect over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="with --tls-ca: a client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="the private key of --tls-cert")


@dataclass(frozen=True)
class Connection:
    """Where the Engine API is and how to reach it, files already read."""

    target: str
    api_key: str | None = field(default=None, repr=False)
    tls: ChannelTls | None = None

    def client(self) -> EngineClient:
        return EngineClient(self.target, api_key=self.api_key, tls=self.tls)


def engine_connection(args: argparse.Namespace) -> Connection:
    """The connection the target flags ask for; ValueError for an unreadable file or a bad combination."""
    if args.tls_ca is None and (args.tls_cert or args.tls_key):
        raise ValueError("--tls-cert and --tls-key need --tls-ca")
    tls = ChannelTls.from_files(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca is not None else None
    return Connection(args.target, api_key(args.api_key_file), tls)


def add_sampling(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=bounded_int(1, INT32_MAX),
                       help="most tokens to generate (default: up to the model's length)")
    group.add_argument("--temperature", type=bounded_float(0), help="0 is greedy (default 1.0)")
    group.add_argument("--top-p", type=bounded_float(0, 1, low_open=True),
                       help="nucleus sampling mass in (0, 1] (default 1.0)")
    group.add_argument("--top-k", type=bounded_int(0, INT32_MAX), default=0, help="keep the k most likely tokens (0: off)")
    group.add_argument("--seed", type=bounded_int(0, UINT64_MAX), help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", type=non_empty, default=[], metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--stop-token-id", action="append", type=bounded_int(0, UINT32_MAX), default=[], metavar="ID",
                       help="stop token id (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    isolation = parser.add_mutually_exclusive_group()
    isolation.add_argument("--cache-salt", type=non_empty, help="share cached prefixes only with requests using this salt "
                           f"(default: ${CACHE_SALT_ENV}, which other users' `ps` cannot see)")
    isolation.add_argument("--tenant", type=non_empty, help="share cached prefixes only within this tenant (salt derived server-side)")
    parser.add_argument("--lora-adapter", type=utf8_text, default="", help="LoRA adapter name (default: the base model)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
        "ignore_eos": args.ignore_eos,
        "cache_salt": cache_salt(args.cache_salt, args.tenant),
        "tenant": args.tenant,
        "lora_adapter": args.lora_adapter,
    }


def run_on_engine(args: argparse.Namespace, command: str, main: Callable[[EngineClient], Awaitable[int]]) -> int:
    """Connect as the target flags say and run `main` with the client. A flag that cannot be used (an
    unreadable key or CA, an empty $PREFIXCACHE_API_KEY) exits 2 before any call; then as
    `report_rpc_errors`."""
    try:
        connection = engine_connection(args)
    except ValueError as error:
        print(f"prefixcache {command}: {error}", file=sys.stderr)
        return 2

    async def connected() -> int:
        async with connection.client() as engine:
            return await main(engine)

    return report_rpc_errors(connected)


def report_rpc_errors(main: Callable[[], Awaitable[int]]) -> int:
    """Run `main`; a failed call prints the server's status code and message and exits 1. Ctrl-C
    ends it quietly with the shell's status for SIGINT (closing the channel cancels the request,
    and the server frees its blocks)."""
    import asyncio

    try:
        return asyncio.run(main())
    except grpc.aio.AioRpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 128 + signal.SIGINT
