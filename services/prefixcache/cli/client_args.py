"""Options and error reporting shared by the client subcommands (generate, chat, stats)."""
from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Awaitable, Callable

import grpc

from prefixcache.arg_types import bounded_float, bounded_int, engine_target, non_empty, utf8_text
from prefixcache.cli.salt_env import CACHE_SALT_ENV, cache_salt
from prefixcache.client import DEFAULT_TARGET

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=engine_target, default=DEFAULT_TARGET, metavar="HOST:PORT", help=f"Engine API (default {DEFAULT_TARGET})")


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
