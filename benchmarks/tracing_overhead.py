"""What tracing costs in request throughput: every span exported at 100% sampling against tracing off (run by hand).

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 24] [--requests 16] [--concurrency 8] [--control]

Two platforms run side by side, each the three services as processes on loopback with the embedded
model: one with tracing off (no exporter), one exporting every span of every service over OTLP/gRPC
(`OTEL_TRACES_SAMPLER=always_on`) to a receiver in this process, which decodes each export and
counts its spans. Rounds alternate between them (A B B A ...), each sending the same requests (a
shared system prompt and a varied question, `--concurrency` at a time); the figure is the median over
rounds of each platform's requests per second, and their ratio. The receiver runs on the same two
cores, as a collector's agent on the same node would. `--control` runs the second platform untraced
too: how far apart two identical platforms come out is the measurement's own noise.

On a machine others share, the wall clock swings with their load far more than tracing moves it, so
the script also reads the CPU time the three services' processes spend per round (from /proc), and
reports requests per CPU-second of the services: on a CPU-bound machine of their own, that is their
throughput, and it holds still while neighbours come and go. For that the workers wait for work
without spinning (`GOMP_SPINCOUNT=0`, both platforms alike): a spinning OpenMP thread burns CPU in
proportion to how long the next step takes to come, which neighbours stretch.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass
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


def start_receiver(port: int) -> tuple[grpc.Server, CountingReceiver]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = CountingReceiver()
    otlp_grpc.add_TraceServiceServicer_to_server(receiver, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, receiver


def platform(log_dir: Path, env: dict[str, str]) -> LocalPlatform:
    return LocalPlatform(PlatformConfig(model_dir=ensure_default_model(), log_dir=log_dir, engine_port=free_port(),
                                        engine_host="127.0.0.1", kv_cache_memory="512MiB", env=env))


def requests(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(17, 49_152) for _ in range(256)]
    return [system + [rng.randrange(17, 49_152) for _ in range(rng.randint(16, 64))] for _ in range(count)]


@dataclass(frozen=True)
class Round:
    per_second: float  # requests per wall-clock second
    cpu_ms: dict[str, float]  # CPU milliseconds per request, by service

    @property
    def per_cpu_second(self) -> float:
        """Requests per CPU-second of the three services' processes."""
        return 1000 / sum(self.cpu_ms.values())


def cpu_seconds(platform: LocalPlatform) -> dict[str, float]:
    """User and system CPU time each of the platform's processes has used (all their threads)."""
    used = {}
    for service in platform.services:
        fields = Path(f"/proc/{service.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        used[service.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return used


async def one_round(platform: LocalPlatform, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Round:
    """`prompts`, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient(platform.engine_address) as engine:
        async def one(prompt: list[int]) -> None:
            async with gate:
                await engine.complete(build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True), timeout_s=600)

        start, before = time.perf_counter(), cpu_seconds(platform)
        await asyncio.gather(*(one(prompt) for prompt in prompts))
        elapsed, after = time.perf_counter() - start, cpu_seconds(platform)
        return Round(len(prompts) / elapsed, {name: (after[name] - before[name]) * 1000 / len(prompts) for name in after})


async def measure(platforms: dict[str, LocalPlatform], args: argparse.Namespace) -> dict[str, list[Round]]:
    """Each round's figures, by platform (one event loop: grpc.aio keeps to the first it sees)."""
    for each in platforms.values():
        await each.wait_ready(300)
    prompts = requests(args.requests, seed=0)
    for each in platforms.values():  # warm up: the prefix cached, every code path run once
        await one_round(each, prompts[:4], args.concurrency, args.max_tokens)
    rounds: dict[str, list[Round]] = {name: [] for name in platforms}
    order = list(platforms)
    for index in range(args.rounds):
        for name in order if index % 2 == 0 else order[::-1]:  # A B, B A, ...: drift lands on both
            measured = await one_round(platforms[name], requests(args.requests, seed=index + 1), args.concurrency,
                                       args.max_tokens)
            rounds[name].append(measured)
            print(f"round {index + 1} {name}: {measured.per_second:.2f} requests/s, "
                  f"{measured.per_cpu_second:.3f} requests per CPU-second", flush=True)
    await asyncio.sleep(2)  # the last batches of spans
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24, help="rounds per platform")
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--control", action="store_true", help="trace neither platform (the noise floor)")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        quiet = {"GOMP_SPINCOUNT": "0"}
        untraced = {**quiet, "OTEL_TRACES_EXPORTER": "none"}
        traced = {**quiet, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_TRACES_SAMPLER": "always_on"}
        second = ("tracing off, again", untraced) if args.control else ("100% sampled, OTLP", traced)
        platforms = {"tracing off": platform(Path(logs) / "off", untraced),
                     second[0]: platform(Path(logs) / "second", second[1])}
        server = None
        try:
            for each in platforms.values():  # before any thread of ours: forking then is safe
                each.start()
            server, receiver = start_receiver(port)  # the exporter retries until it is up
            rounds = asyncio.run(measure(platforms, args))
        finally:
            for each in platforms.values():
                each.stop()
            if server is not None:
                server.stop(0)
    print(f"\n{args.rounds} rounds each of {args.requests} requests ({args.concurrency} at a time, 256-token shared "
          f"prefix + 16-64 tokens, {args.max_tokens} generated); medians of the rounds")
    for name, measured in rounds.items():
        services = ", ".join(f"{service} {statistics.median(r.cpu_ms[service] for r in measured):.0f}"
                             for service in measured[0].cpu_ms)
        print(f"{name:<20} {statistics.median(r.per_second for r in measured):6.2f} requests/s, "
              f"{statistics.median(r.per_cpu_second for r in measured):6.3f} requests per CPU-second "
              f"(CPU ms per request: {services})")
    first, second = rounds.values()
    for label, figure in (("wall clock", "per_second"), ("CPU time", "per_cpu_second")):
        ratios = [getattr(b, figure) / getattr(a, figure) for a, b in zip(first, second)]
        print(f"{' / '.join(reversed(rounds))} throughput, {label}: {statistics.median(ratios) - 1:+.1%} "
              f"(median of the rounds' ratios)")
    print(f"spans received: {sum(receiver.spans.values())} "
          f"({', '.join(f'{name} {count}' for name, count in sorted(receiver.spans.items()))})")


if __name__ == "__main__":
    main()
