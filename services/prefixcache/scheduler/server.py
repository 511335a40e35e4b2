"""The scheduler service: the public Engine API, with the KV cache manager, over a remote worker.

`prefixcache scheduler --port 50051 --tokenizer HOST:PORT --worker HOST:PORT [--block-size 16]
[--hash-algo sha256] [--no-prefix-caching] [--max-num-seqs 32] ...`. Health says SERVING once the
worker has initialized its KV cache for our block size (the worker may start later: we keep trying).
While a lost worker is being replaced, or the tokenizer does not answer, the Engine service's health
says NOT_SERVING (the process's, "", stays SERVING, so a liveness probe does not restart a healthy
scheduler). On SIGTERM, new requests are refused while in-flight ones get the grace period to finish.

`--tenants FILE` turns tenancy on: every call must then authenticate as a tenant or an admin of that
file (`prefixcache.scheduler.tenancy`), read again when it changes. `--tls-*` serve the Engine API
over TLS; `--tokenizer-tls-ca`/`--worker-tls-ca` (with `--client-tls-cert`/`--client-tls-key` for
mutual TLS) call the other services over TLS.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from grpc_health.v1.health import aio as health_aio

from prefixcache.arg_types import block_size, listen_port
from prefixcache.block_identity.hashing import HASH_ALGOS
from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.protos.engine.v1 import kv_cache_pb2_grpc
from prefixcache.rpc.metrics_http import start_service_metrics
from prefixcache.rpc.server import Servicer, add_health_port_argument, configure_logging, probe_address, run_server
from prefixcache.rpc.tls import ChannelTls, add_server_tls_arguments, server_tls
from prefixcache.rpc.tracing import SpanRegistry
from prefixcache.scheduler.api import kv_cache_servicer
from prefixcache.scheduler.api.codec import DEFAULT_MAX_PROMPT_BYTES
from prefixcache.scheduler.api.kv_cache_servicer import KvCacheServicer
from prefixcache.scheduler.api.servicer import SERVICE_NAME, EngineServicer
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.engine import EngineCore, WorkerUnavailable
from prefixcache.scheduler.readiness import Readiness
from prefixcache.scheduler.tenancy import KEY_ENV, ConfigError, TenantRegistry, TenantSalts
from prefixcache.scheduler.tokenizer_client import TokenizerClient
from prefixcache.scheduler.worker_client import GrpcStepExecutor

log = logging.getLogger(__name__)
STARTUP_RETRY_S = 0.5
ABORTED_STREAMS_CLOSE_S = 2.0  # how long streams aborted at the end of the grace get to send their last response


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SchedulerConfig()
    parser.add_argument("--port", type=listen_port, default=50051, help="Engine API port")
    parser.add_argument("--host", default="[::]", help="address to bind (default: all interfaces)")
    parser.add_argument("--tokenizer", required=True, metavar="HOST:PORT", help="tokenizer service")
    parser.add_argument("--worker", required=True, metavar="HOST:PORT", help="worker service")
    parser.add_argument("--block-size", type=block_size, default=defaults.block_size,
                        help="tokens per KV block (a power of two)")
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default=defaults.hash_algo, help="block hash algorithm")
    parser.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off (the second spelling is vLLM's)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="requests per step at most")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens, help="token budget per step"
    )
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting, help="waiting requests at most")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len, help="prompt + output at most")
    parser.add_argument("--schedule-ahead", action=argparse.BooleanOptionalAction, default=defaults.schedule_ahead,
                        help="send a decode step while the one before it runs (default: on)")
    parser.add_argument("--metrics-port", type=listen_port, default=None,
                        help="serve Prometheus metrics on this port (the chart uses 9090)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--tenants", type=Path, metavar="FILE",
                        help="tenants and admins with their credentials (JSON; read again when it changes); "
                             "every call must then authenticate (default: no tenants, the local single-user mode)")
    parser.add_argument("--admins", type=Path, metavar="FILE",
                        help="more admins, in a file of the tenants file's format (read again when it changes); "
                             "needs --tenants")
    parser.add_argument("--tenant-salt-key-file", type=Path, metavar="FILE",
                        help="the key tenants' salts are derived from when the tenants file has no salt_key, "
                             f"or for the `tenant` field without tenants (read again when it changes; "
                             f"default: ${KEY_ENV}, else a random key per process)")
    parser.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                        help="refuse a text or chat prompt larger than this before tokenizing it")
    add_health_port_argument(parser)
    add_server_tls_arguments(parser)
    peers = parser.add_argument_group("TLS to the tokenizer and the worker (default: plaintext)")
    peers.add_argument("--tokenizer-tls-ca", type=Path, metavar="FILE", help="CA of the tokenizer's certificate")
    peers.add_argument("--worker-tls-ca", type=Path, metavar="FILE", help="CA of the worker's certificate")
    peers.add_argument("--client-tls-cert", type=Path, metavar="FILE",
                       help="this scheduler's certificate, for services that require one (mutual TLS)")
    peers.add_argument("--client-tls-key", type=Path, metavar="FILE", help="the private key of --client-tls-cert")


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        max_model_len=args.max_model_len,
        schedule_ahead=args.schedule_ahead,
    )


def peer_tls(args: argparse.Namespace, ca: Path | None) -> ChannelTls | None:
    """TLS toward a service whose certificate `ca` signed (None: plaintext); ValueError naming a flag."""
    if (args.client_tls_cert is None) != (args.client_tls_key is None):
        raise ValueError("--client-tls-cert and --client-tls-key go together")
    return ChannelTls.from_files(ca, args.client_tls_cert, args.client_tls_key) if ca is not None else None


async def serve(args: argparse.Namespace) -> int:
    if args.admins is not None and args.tenants is None:
        log.error("--admins needs --tenants: without tenants every caller may read the whole cache")
        return 2
    try:
        salts = TenantSalts(key_file=args.tenant_salt_key_file) if args.tenant_salt_key_file else TenantSalts()
    except (OSError, ValueError) as error:
        log.error("--tenant-salt-key-file: %s", error)  # names the file, never the key
        return 2
    try:
        registry = TenantRegistry(args.tenants, admins_path=args.admins, fallback_salts=salts) \
            if args.tenants is not None else None
    except (ConfigError, OSError) as error:  # a ConfigError names the field, never a value
        log.error("--tenants %s: %s", args.tenants, error)
        return 2
    request_spans = SpanRegistry()
    try:
        config = config_from_args(args)
        tls = server_tls(args)
        executor = GrpcStepExecutor(args.worker, request_spans=request_spans,
                                    tls=peer_tls(args, args.worker_tls_ca))
        tokenizer = TokenizerClient(args.tokenizer, tls=peer_tls(args, args.tokenizer_tls_ca))
    except ValueError as error:
        log.error("%s", error)
        return 2
    engine = EngineCore(config, executor)
    servicer = EngineServicer(engine, tokenizer, request_spans=request_spans, registry=registry, tenants=salts,
                              max_prompt_bytes=args.max_prompt_bytes)
    health = health_aio.HealthServicer()
    readiness = Readiness(health, SERVICE_NAME, tokenizer.is_serving)
    engine.on_worker_availability = readiness.worker_available
    kv_cache = KvCacheServicer(engine, registry)
    # Metrics first: a port that is taken fails the start at once, not after the worker's model has
    # loaded, and the counters can be scraped while the scheduler waits for the worker.
    try:
        interceptors = start_service_metrics(args.metrics_port, args.host, lambda: engine.metrics.model_name,
                                             engine.metrics.registry)
    except RuntimeError as error:
        log.error("%s", error)
        return 1

    async def start_engine() -> None:
        while True:
            try:
                await engine.start()
                break
            except WorkerUnavailable as error:
                log.info("waiting for the worker: %s", error)
                await asyncio.sleep(STARTUP_RETRY_S)
        while not await tokenizer.is_serving():
            log.info("waiting for the tokenizer at %s", tokenizer.target)
            await asyncio.sleep(STARTUP_RETRY_S)
        readiness.watch_tokenizer()
        info = engine.worker_info
        log.info("engine ready: %s, %d KV blocks of %d tokens", info.model_id, info.num_kv_blocks, config.block_size)

    async def stop_engine(grace_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + grace_s
        kv_cache.close()  # KV events subscribers stream forever: end them, or they would hold the stop
        await readiness.stop()
        await engine.shutdown(grace_s)
        # Streams aborted at the deadline still send their final response: give them a moment.
        remaining = max(deadline - asyncio.get_running_loop().time(), ABORTED_STREAMS_CLOSE_S)
        if not await servicer.wait_generate_calls_done(remaining):
            log.warning("Generate calls still open after the grace period; closing anyway")
        await tokenizer.close()
        await executor.close()

    registration = Servicer(SERVICE_NAME, lambda server: pb_grpc.add_EngineServicer_to_server(servicer, server))
    kv_cache_registration = Servicer(kv_cache_servicer.SERVICE_NAME,
                                     lambda server: kv_cache_pb2_grpc.add_KvCacheServicer_to_server(kv_cache, server))
    return await run_server(
        "prefixcache-scheduler",
        f"{args.host}:{args.port}",
        [registration, kv_cache_registration],
        grace_s=args.grace,
        startup=start_engine,
        shutdown=stop_engine,
        health=health,
        tls=tls, health_address=probe_address(args),
        interceptors=interceptors,
    )


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    return asyncio.run(serve(args))
