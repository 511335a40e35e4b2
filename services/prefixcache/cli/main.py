"""The `prefixcache` command line: one subcommand per module, imported only when used.

Lazy imports keep `prefixcache --help` instant and let a tokenizer or scheduler image run its
subcommand without torch installed.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

from prefixcache.rpc.fork_handlers import turn_off_grpc_fork_handlers


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str


# Each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: tuple[Command, ...] = (
    Command("serve", "prefixcache.cli.serve", "run all three services on loopback"),
    Command("generate", "prefixcache.cli.generate", "stream one completion"),
    Command("chat", "prefixcache.cli.chat", "interactive chat against an engine"),
    Command("stats", "prefixcache.cli.stats", "print the prefix-cache counters"),
    Command("events", "prefixcache.cli.events", "tail a scheduler's KV events stream (cached block hashes)"),
    Command("diagnose", "prefixcache.cli.diagnose", "is the prefix cache thrashing, and what memory would fix it"),
    Command("bench", "prefixcache.cli.bench", "serving benchmark, with and without the cache"),
    Command("tokenizer", "prefixcache.tokenizer.server", "run the tokenizer service"),
    Command("scheduler", "prefixcache.scheduler.server", "run the scheduler/engine service"),
    Command("worker", "prefixcache.worker.server", "run the worker service"),
    Command("model", "prefixcache.cli.model", "manage the local model cache (pull, show)"),
    Command("block-hashes", "prefixcache.cli.block_hashes", "print block hashes of token ids read from stdin"),
)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None
    for command in COMMANDS:
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        if command.name == chosen:
            module = importlib.import_module(command.module)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    turn_off_grpc_fork_handlers()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader went away (`prefixcache generate … | head`): stop quietly, and keep the
        # interpreter's final flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
