"""`prefixcache bench`: drive seeded workloads through an Engine and report what the cache buys.

With no --target it starts its own local platform (the three services, as `prefixcache serve`
does, on free loopback ports) for each mode, so --compare-no-cache runs on a fresh server with
prefix caching off and otherwise the same settings.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import sys

from prefixcache.services.bench.workloads import GENERATORS, IntRange, WorkloadOptions


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already says it, or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def int_range_argument(text: str) -> IntRange:
    """`IntRange.parse` for argparse, which shows an `ArgumentTypeError`'s message (and hides a `ValueError`'s)."""
    try:
        return IntRange.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsHelpFormatter
    where = parser.add_argument_group("where")
    where.add_argument("--target", metavar="HOST:PORT", help="a running Engine endpoint (default: start a local platform)")
    where.add_argument("--compare-no-cache", action="store_true", help="also run with prefix caching off and print ratios")
    where.add_argument("--no-cache-target", metavar="HOST:PORT",
                       help="with --target and --compare-no-cache: an endpoint serving with prefix caching off")
    where.add_argument("--dtype", default="float32", help="local platform: the worker's compute dtype")
    where.add_argument("--kv-cache-memory", default="1GiB", help="local platform: the worker's KV cache budget")
    where.add_argument("--scheduler-arg", action="append", default=[], metavar="ARG",
                       help="local platform: extra scheduler flag (repeatable), e.g. --scheduler-arg=--max-num-seqs=16")
    where.add_argument("--reset-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="reset the prefix cache before each workload (default: only on the local platform)")

    what = parser.add_argument_group("workload")
    what.add_argument("--workload", action="append", default=[], metavar="NAME",
                      help=f"workload(s) to run, repeatable or comma-separated: {', '.join(GENERATORS)} (default: all)")
    what.add_argument("--num-requests", type=int, default=None,
                      help="requests per workload (default: 32; thrash: three visits to each prefix)")
    what.add_argument("--concurrency", type=int, default=8, help="most requests in flight")
    what.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate in requests/s (inf: all at once)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--tenants", type=int, default=1, help="tenants, each with its own secret cache salt")
    what.add_argument("--prefix-len", type=int, default=1000,
                      help="system prompt / all few-shot examples / each thrash prefix, in tokens")
    what.add_argument("--suffix-len", type=int_range_argument, default=IntRange(50, 200), metavar="A:B",
                      help="user turn / question / thrash suffix length range, in tokens")
    what.add_argument("--turns", type=int_range_argument, default=IntRange(4, 8), metavar="A:B", help="multi-turn conversation length")
    what.add_argument("--output-len", type=int, default=32, help="tokens generated per request (greedy, EOS ignored)")
    what.add_argument("--few-shot-examples", type=int, default=8)
    what.add_argument("--thrash-prefixes", type=int, default=None,
                      help="distinct thrash prefixes (default: a few more than the engine's KV pool holds)")
    what.add_argument("--warmup", type=int, default=2, help="unrecorded requests sent before each mode")
    what.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the results as JSON (keys in docs/bench.md)")
    out.add_argument("--plot", metavar="FILE.png", help="draw TTFT distributions and hit rate over time")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    # Problems with the outputs are reported before a long run, not after it.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("prefixcache bench: --plot needs matplotlib (pip install 'prefixcache[bench]')", file=sys.stderr)
        return 2
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and (problem := _unwritable(path)):
            print(f"prefixcache bench: {option} {path}: {problem}", file=sys.stderr)
            return 2
    # Imported here so `prefixcache bench --help` stays instant.
    import grpc

    from prefixcache.services.bench.local_platform import LocalSettings
    from prefixcache.services.bench.report import render_table, write_json
    from prefixcache.services.bench.session import BenchConfig, parse_workloads, run_session

    try:
        options = WorkloadOptions(
            **({"num_requests": args.num_requests, "thrash_requests": args.num_requests}
               if args.num_requests is not None else {}),
            seed=args.seed,
            tenants=args.tenants,
            request_rate=args.request_rate,
            output_len=args.output_len,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            turns=args.turns,
            few_shot_examples=args.few_shot_examples,
            **({"thrash_prefixes": args.thrash_prefixes} if args.thrash_prefixes is not None else {}),
        )
        config = BenchConfig(
            workloads=parse_workloads(args.workload, list(GENERATORS)),
            options=options,
            concurrency=args.concurrency,
            target=args.target,
            no_cache_target=args.no_cache_target,
            compare_no_cache=args.compare_no_cache,
            auto_thrash_prefixes=args.thrash_prefixes is None,
            warmup_requests=args.warmup,
            reset_between_workloads=args.reset_cache,
            local=LocalSettings(args.dtype, args.kv_cache_memory, tuple(args.scheduler_arg)),
            request_timeout_s=args.request_timeout,
            show_progress=not args.no_progress,
        )
        outcome = asyncio.run(run_session(config))
    except (ValueError, RuntimeError, TimeoutError) as error:
        print(f"prefixcache bench: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:  # a failure outside a request (Describe, stats): the server's status
        print(f"prefixcache bench: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1

    print(render_table(outcome.results))
    try:
        if args.json:
            write_json(args.json, outcome.results, outcome.description)
        if args.plot:
            from prefixcache.services.bench.plot import plot

            plot(args.plot, outcome.results)
    except OSError as error:  # the file system changed during the run
        print(f"prefixcache bench: cannot write {error.filename}: {error.strerror}", file=sys.stderr)
        return 1
    if outcome.failed_requests:
        print(f"prefixcache bench: {outcome.failed_requests} requests failed", file=sys.stderr)
        return 1
    return 0


def _unwritable(path: str) -> str | None:
    """Why a file cannot be written at `path`, or None if it can (as far as can be told beforehand)."""
    if os.path.isdir(path):
        return "is a directory"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"no such directory {directory}"
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return None
