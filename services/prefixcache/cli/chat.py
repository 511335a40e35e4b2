"""`prefixcache chat`: an interactive conversation; every turn resends the history, so the previous
turns come from the prefix cache (the usage line after each reply shows how many tokens).

A turn the server refuses, or a line that is not UTF-8, is reported, left out of the history, and
makes the exit status 1; a reply with no text is reported and its turn left out too (an empty
assistant message could not be sent back). Either way the conversation goes on.
"""
from __future__ import annotations

import argparse
import io
import sys

import grpc

from prefixcache.arg_types import text_file
from prefixcache.cli.client_args import add_sampling, add_target, engine_connection, report_rpc_errors, sampling_kwargs
from prefixcache.cli.generate import print_usage
from prefixcache.client import Completion, build_request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--system", type=text_file, metavar="FILE", help="system prompt file")
    add_sampling(parser)


def run(args: argparse.Namespace) -> int:
    try:
        sampling = sampling_kwargs(args)
        connection = engine_connection(args)
    except ValueError as error:  # an empty (or not UTF-8) $PREFIXCACHE_CACHE_SALT, an unreadable key or CA
        print(f"prefixcache chat: {error}", file=sys.stderr)
        return 2
    if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable input is refused per line, not raised
        sys.stdin.reconfigure(errors="surrogateescape")
    history: list[tuple[str, str]] = []
    if args.system is not None:
        history.append(("system", args.system))

    prompt = "you> " if sys.stdin.isatty() else ""  # piped turns need no prompt in the transcript

    async def main() -> int:
        failed = False
        async with connection.client() as engine:
            while True:
                try:
                    line = input(prompt)
                except EOFError:
                    print()
                    return 1 if failed else 0
                if not line.strip():
                    continue
                line = _line_as_utf8(line)
                if line is None:
                    print("(not valid UTF-8 text: turn not sent)", file=sys.stderr)
                    failed = True
                    continue
                completion = Completion()
                print("assistant> ", end="", flush=True)
                request = build_request(messages=[*history, ("user", line)], **sampling)
                try:
                    async for chunk in engine.generate(request):
                        completion.add(chunk)
                        print(chunk.text, end="", flush=True)
                except grpc.aio.AioRpcError as error:
                    print(f"\nerror: {error.code().name}: {error.details()} (turn not kept)", file=sys.stderr)
                    failed = True
                    continue
                print()
                print_usage(completion)
                if completion.text:
                    history.extend([("user", line), ("assistant", completion.text)])
                else:  # an empty assistant message cannot be sent back: drop the whole turn
                    print("(empty reply: turn not kept)", file=sys.stderr)

    return report_rpc_errors(main)


def _line_as_utf8(line: str) -> str | None:
    """The bytes of a line read from stdin, as UTF-8 text (None if they are not UTF-8), whatever
    encoding stdin decoded them with: the same reading as the command's arguments get."""
    try:
        return line.encode(sys.stdin.encoding or "utf-8", "surrogateescape").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return None
