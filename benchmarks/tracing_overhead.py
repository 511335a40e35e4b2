"""What tracing costs in request throughput: every span exported at 100% sampling against tracing off (run by hand).

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 8] [--requests 16] [--concurrency 8]

Two platforms run side by side, each the three services as processes on loopback with the embedded
model: one with tracing off (no exporter), one exporting every span of every service over OTLP/gRPC
(`OTEL_TRACES_SAMPLER=always_on`) to a receiver in this process, which decodes each export and
counts its spans. Rounds alternate between them (A B B A ...), each sending the same requests (a
shared system prompt and a varied question, `--concurrency` at a time); the figure is the median over
rounds of each platform's requests per second, and their ratio. The receiver runs on the same two
cores, as a collector's agent on the same node would.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from prefixcache.client import EngineClient, build_request
from prefixcache.launcher import LocalPlatform, PlatformConfig, free_port
from prefixcache.model_store.store import ensure_default_model


class CountingReceiver(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that decodes every export and counts the spans, by service."""

    def __init__(self) -> None:
        self.spans: dict[str, int] = {}

    def Export(self, request: otlp.ExportTraceServiceRequest, context: grpc.ServicerContext) -> otlp.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "?")
            count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
            self.spans[service] = self.spans.get(service, 0) + count
        return otlp.ExportTraceServiceResponse()


def start_receiver() -> tuple[grpc.Server, CountingReceiver, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = CountingReceiver()
    otlp_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, receiver, port


def platform(log_dir: Path, env: dict[str, str]) -> LocalPlatform:
    return LocalPlatform(PlatformConfig(model_dir=ensure_default_model(), log_dir=log_dir, engine_port=free_port(),
                                        engine_host="127.0.0.1", kv_cache_memory="512MiB", env=env))


def requests(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(17, 49_152) for _ in range(256)]
    return [system + [rng.randrange(17, 49_152) for _ in range(rng.randint(16, 64))] for _ in range(count)]


async def one_round(target: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Requests per second for `prompts`, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient(target) as engine:
        async def one(prompt: list[int]) -> None:
            async with gate:
                await engine.complete(build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True), timeout_s=600)

        start = time.perf_counter()
        await asyncio.gather(*(one(prompt) for prompt in prompts))
        return len(prompts) / (time.perf_counter() - start)


async def measure(platforms: dict[str, LocalPlatform], args: argparse.Namespace) -> dict[str, list[float]]:
    """Requests per second of each round, by platform (one event loop: grpc.aio keeps to the first)."""
    for each in platforms.values():
        await each.wait_ready(300)
    prompts = requests(args.requests, seed=0)
    for each in platforms.values():  # warm up: the prefix cached, every code path run once
        await one_round(each.engine_address, prompts[:4], args.concurrency, args.max_tokens)
    rates: dict[str, list[float]] = {name: [] for name in platforms}
    order = list(platforms)
    for index in range(args.rounds):
        for name in order if index % 2 == 0 else order[::-1]:  # A B, B A, ...: drift lands on both
            rate = await one_round(platforms[name].engine_address, requests(args.requests, seed=index + 1),
                                   args.concurrency, args.max_tokens)
            rates[name].append(rate)
            print(f"round {index + 1} {name}: {rate:.2f} requests/s", flush=True)
    await asyncio.sleep(2)  # the last batches of spans
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per platform")
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    server, receiver, port = start_receiver()
    with tempfile.TemporaryDirectory() as logs:
        platforms = {
            "tracing off": platform(Path(logs) / "off", {"OTEL_TRACES_EXPORTER": "none"}),
            "100% sampled, OTLP": platform(Path(logs) / "on", {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                                               "OTEL_TRACES_SAMPLER": "always_on"}),
        }
        try:
            for each in platforms.values():
                each.start()
            rates = asyncio.run(measure(platforms, args))
        finally:
            for each in platforms.values():
                each.stop()
            server.stop(0)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratios = [traced / untraced for untraced, traced in zip(*rates.values())]
    print(f"\n{args.rounds} rounds each of {args.requests} requests ({args.concurrency} at a time, 256-token shared "
          f"prefix + 16-64 tokens, {args.max_tokens} generated)")
    for name, median in medians.items():
        print(f"{name:<20} {median:6.2f} requests/s (median)")
    print(f"traced / untraced, median of the rounds' ratios: {statistics.median(ratios) - 1:+.1%} throughput")
    print(f"spans received: {sum(receiver.spans.values())} "
          f"({', '.join(f'{name} {count}' for name, count in sorted(receiver.spans.items()))})")


if __name__ == "__main__":
    main()
