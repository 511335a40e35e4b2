"""`prefixcache serve`: tokenizer, worker and scheduler as three local processes, on loopback.

The Engine API listens on localhost:50051 unless --port says otherwise. SIGTERM or Ctrl-C stops the
scheduler first (it finishes in-flight requests within the grace period), then the others.
`--demo` sends two chat requests that share a long system prompt, prints how many of the second
one's prompt tokens came from the prefix cache, and stops.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import grpc

from prefixcache.arg_types import block_size, bounded_int
from prefixcache.block_identity.hashing import HASH_ALGOS
from prefixcache.cli.salt_env import API_KEY_ENV, env_secret
from prefixcache.client import Completion, EngineClient, build_request
from prefixcache.launcher import LocalPlatform, PlatformConfig, default_log_dir
from prefixcache.rpc.server import set_on_signals

T = TypeVar("T")

DEMO_SYSTEM_PROMPT = " ".join(
    f"Rule {n}: {rule}"
    for n, rule in enumerate(
        [
            "Answer in one short sentence unless the user asks for detail.",
            "Prefer plain words over jargon; define any term a newcomer would not know.",
            "When a question is ambiguous, state the reading you chose before answering.",
            "Never invent citations, numbers or quotes; say when you do not know.",
            "Use metric units, and give both units when the user used imperial ones.",
            "Keep code examples minimal, runnable, and in the language the user used.",
            "For arithmetic, show the one line of working that leads to the result.",
            "Refuse politely and briefly when asked for something harmful.",
            "Do not repeat the question back to the user.",
            "If the user greets you, greet them back in a few words and ask how to help.",
        ]
        * 4,
        start=1,
    )
)
DEMO_QUESTIONS = ("What is the capital of France?", "What is two plus two?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=bounded_int(1, 65535), default=50051, help="Engine API port (default 50051)")
    parser.add_argument("--host", default="localhost", help="Engine API address (default localhost)")
    parser.add_argument("--model-dir", type=Path, help="Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on a GPU that has it, else float32), float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="the worker's torch device (cpu, cuda)")
    parser.add_argument("--attention-backend", help="the worker's attention kernels by name (default: per device)")
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="worker KV cache budget: bytes (512MiB) or a fraction of free memory (0.4)")
    parser.add_argument("--block-size", type=block_size, default=16, help="tokens per KV block (a power of two)")
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256", help="block hash algorithm")
    parser.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off (the second spelling is vLLM's)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-waiting", type=int, help="waiting requests at most (default: the scheduler's)")
    parser.add_argument("--max-model-len", type=int, help="prompt + output at most (default: the scheduler's)")
    parser.add_argument("--schedule-ahead", action=argparse.BooleanOptionalAction, default=True,
                        help="send a decode step while the one before it runs (default: on)")
    parser.add_argument("--metrics-port", type=bounded_int(1, 65535), help="serve the scheduler's Prometheus metrics on this port")
    parser.add_argument("--tenants", type=Path, metavar="FILE",
                        help="the scheduler's tenants file: every call must then carry a tenant's or an admin's "
                             "credentials (--demo sends $PREFIXCACHE_API_KEY)")
    parser.add_argument("--log-dir", type=Path, help="where the services write their logs")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for all services")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds in-flight requests get on shutdown")
    parser.add_argument("--demo", action="store_true", help="send two requests sharing a system prompt, then stop")


def platform_config(args: argparse.Namespace, model_dir: Path) -> PlatformConfig:
    scheduler_args = [
        "--block-size", str(args.block_size), "--hash-algo", args.hash_algo,
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip
    if args.no_prefix_caching:
        scheduler_args.append("--no-prefix-caching")
    if not args.schedule_ahead:
        scheduler_args.append("--no-schedule-ahead")
    for flag, value in (("--max-waiting", args.max_waiting), ("--max-model-len", args.max_model_len),
                        ("--metrics-port", args.metrics_port), ("--tenants", args.tenants)):
        if value is not None:
            scheduler_args += [flag, str(value)]
    worker_args = ["--device", args.device]
    if args.attention_backend is not None:
        worker_args += ["--attention-backend", args.attention_backend]
    return PlatformConfig(
        model_dir=model_dir,
        log_dir=args.log_dir or default_log_dir(),
        engine_port=args.port,
        engine_host=args.host,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        scheduler_args=scheduler_args,
        worker_args=worker_args,
        grace_s=args.grace,
    )


def run(args: argparse.Namespace) -> int:
    from prefixcache.model_store.store import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()  # once here, not in three processes at once
    platform = LocalPlatform(platform_config(args, model_dir))
    try:
        code = asyncio.run(_serve(platform, args))
    finally:
        # The stop is bounded (each service's grace plus a margin): a second Ctrl-C must not cut it
        # short and leave services that ignore SIGINT running.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        statuses = platform.stop()
    # -SIGTERM: stopped by our own SIGTERM before it could set up its handler (still starting).
    failed = {name: status for name, status in statuses.items() if status not in (0, None, -signal.SIGTERM)}
    if failed:
        print(f"services exited with errors: {failed} (logs in {platform.config.log_dir})", file=sys.stderr)
        return code or 1
    return code


async def _serve(platform: LocalPlatform, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    set_on_signals(stop, (signal.SIGTERM, signal.SIGINT))  # they stay set while `run` stops the services
    print(f"starting tokenizer, worker and scheduler (logs in {platform.config.log_dir})", flush=True)
    platform.start()
    try:
        started, _ = await _unless_stopped(platform.wait_ready(args.startup_timeout), stop)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not started:
        print("stopping", flush=True)
        return 0
    target = f"{args.host}:{args.port}"
    print(f"Engine API serving on {target}", flush=True)
    if args.demo:
        finished, code = await _unless_stopped(_demo(target), stop)
        return code if finished else 1
    while not stop.is_set():
        exited = platform.exited()
        if exited is not None:
            print(f"error: the {exited.name} exited unexpectedly:\n{exited.log_tail()}", file=sys.stderr)
            return 1
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    print("stopping", flush=True)
    return 0


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """(True, its result) once `work` is done, or (False, None) if `stop` is set first (it is then
    cancelled): a Ctrl-C during a long startup stops at once."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False, None
    return True, task.result()


async def _demo(target: str) -> int:
    try:
        key = env_secret(API_KEY_ENV)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    async with EngineClient(target, api_key=key) as engine:
        print(f"demo: two chat requests sharing a long system prompt ({len(DEMO_SYSTEM_PROMPT)} characters)")
        for number, question in enumerate(DEMO_QUESTIONS, start=1):
            request = build_request(
                messages=[("system", DEMO_SYSTEM_PROMPT), ("user", question)], max_tokens=32, temperature=0.0
            )
            started = time.perf_counter()
            first_token_s = None
            completion = Completion()
            try:
                async for chunk in engine.generate(request, timeout_s=300):
                    if first_token_s is None and chunk.token_ids:
                        first_token_s = time.perf_counter() - started
                    completion.add(chunk)
            except grpc.aio.AioRpcError as error:
                print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            usage = completion.usage
            print(
                f"  request {number}: {question!r} -> {completion.text.strip()!r}\n"
                f"    prompt {usage.prompt_tokens} tokens, cached {usage.cached_tokens}, "
                f"time to first token {first_token_s or 0:.2f} s"
            )
        print(f"the second request's cached tokens: {usage.cached_tokens}")
    return 0
