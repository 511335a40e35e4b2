"""`prefixcache chat`: an interactive conversation; every turn resends the history, so the previous
turns come from the prefix cache (the usage line after each reply shows how many tokens)."""
from __future__ import annotations

import argparse
from pathlib import Path

from prefixcache.services.cli.client_args import add_sampling, add_target, report_rpc_errors, sampling_kwargs
from prefixcache.services.cli.generate import print_usage
from prefixcache.services.common.engine_client import Completion, EngineClient, build_request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--system", type=Path, metavar="FILE", help="system prompt file")
    add_sampling(parser)


def run(args: argparse.Namespace) -> int:
    history: list[tuple[str, str]] = []
    if args.system is not None:
        history.append(("system", args.system.read_text()))

    async def main() -> int:
        async with EngineClient(args.target) as engine:
            while True:
                try:
                    line = input("you> ")
                except EOFError:
                    print()
                    return 0
                if not line.strip():
                    continue
                history.append(("user", line))
                completion = Completion()
                print("assistant> ", end="", flush=True)
                async for chunk in engine.generate(build_request(messages=history, **sampling_kwargs(args))):
                    completion.add(chunk)
                    print(chunk.text, end="", flush=True)
                print()
                print_usage(completion)
                history.append(("assistant", completion.text))

    return report_rpc_errors(main)
