"""`benchmarks/vs_vllm.py`'s client side, against a loopback HTTP server that speaks vLLM's streaming
`/v1/completions` (vLLM itself needs its own venv and minutes to start; the benchmark runs it).

What matters for a fair comparison: every stream the driver starts is open on the server at once,
so vLLM sees the same concurrency as our engine does.
"""
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import vs_vllm

from prefixcache.bench.driver import TenantSalts, drive
from prefixcache.bench.workloads import BenchRequest

CONCURRENCY = 12  # above asyncio's default pool on small machines (min(32, CPUs + 4))


class CompletionsHandler(BaseHTTPRequestHandler):
    """Holds every stream until `CONCURRENCY` are open (or a timeout), then streams two tokens each."""

    all_open: threading.Barrier
    bodies: list[dict]

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        try:
            self.all_open.wait(timeout=10)
        except threading.BrokenBarrierError:
            self.send_error(503, "fewer streams open at once than the driver's concurrency")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": 16}}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def completions_server():
    handler = type("Handler", (CompletionsHandler,), {"all_open": threading.Barrier(CONCURRENCY), "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


def test_every_stream_is_open_at_once_and_usage_is_read(completions_server):
    port, handler = completions_server
    endpoint = vs_vllm.VllmEndpoint(port, max_streams=CONCURRENCY, request_timeout_s=30)
    requests = [BenchRequest(f"r{i}", tuple(range(17, 57)), max_tokens=2, tenant=0) for i in range(CONCURRENCY)]
    try:
        records = asyncio.run(drive(endpoint, requests, concurrency=CONCURRENCY, salts=TenantSalts(1))).records
    finally:
        endpoint.close()
    assert [r.error for r in records] == [None] * CONCURRENCY
    assert all(r.prompt_tokens == 40 and r.cached_tokens == 16 and r.completion_tokens == 2 for r in records)
    assert all(len(r.chunks) == 2 and r.ttft_s > 0 for r in records)
    assert {body["cache_salt"] for body in handler.bodies} and all(body["ignore_eos"] for body in handler.bodies)
