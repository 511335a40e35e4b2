"""Services as real processes: health, reflection, SIGTERM; and what each service's image must not need."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prefixcache.launcher import ServiceProcess, free_port
from prefixcache.protos.engine.v1 import engine_pb2, engine_pb2_grpc
from prefixcache.rpc.client import is_serving, open_channel, wait_until_serving


def test_tokenizer_process_serves_health_and_reflection_and_exits_0_on_sigterm(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "prefixcache.cli.main", "tokenizer", "--host", "127.0.0.1",
               "--port", str(port), "--model-dir", str(model_dir)]  # fmt: skip
    log = (tmp_path / "tokenizer.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(wait_until_serving(f"127.0.0.1:{port}", timeout_s=60, service="prefixcache.tokenizer.v1.Tokenizer"))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # the reflection client is synchronous
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"prefixcache.tokenizer.v1.Tokenizer", "grpc.health.v1.Health"} <= services
        # The v1 name of reflection answers too (the same messages as v1alpha's).
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                         request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                         response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            [reply] = list(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
        listed = {service.name for service in reply.list_services_response.service}
        assert {"prefixcache.tokenizer.v1.Tokenizer", "grpc.reflection.v1.ServerReflection"} <= listed
        # Bytes that are no TokenizeRequest (field 1, text, holding invalid UTF-8), unary and streamed:
        # INVALID_ARGUMENT naming the message, and the service goes on.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for call in (channel.unary_unary("/prefixcache.tokenizer.v1.Tokenizer/Tokenize"),
                         lambda data, timeout: list(channel.stream_stream(
                             "/prefixcache.tokenizer.v1.Tokenizer/DetokenizeStream")(iter([data]), timeout=timeout))):
                with pytest.raises(grpc.RpcError) as refused:
                    call(b"\x0a\x01\xff", timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details().startswith("request: not a valid prefixcache.tokenizer.v1.")
            reply = channel.unary_unary("/prefixcache.tokenizer.v1.Tokenizer/Tokenize")(b"\x0a\x02hi", timeout=30)
            assert reply  # the token ids of "hi"
        # A second server on the same port must fail, not share the port with the first.
        second = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "cannot listen" in second.stderr, second.stderr[-2000:]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    log_text = (tmp_path / "tokenizer.log").read_text()
    assert "shutting down" in log_text and "Traceback" not in log_text


def test_a_service_under_serve_ignores_ctrl_c_and_survives_repeated_sigterms(model_dir: Path, tmp_path: Path) -> None:
    """`serve` starts its services with SIGINT ignored (it stops them itself, in order), and a
    service keeps ignoring stop signals once its shutdown began, up to its exit: a supervisor's
    SIGTERM on top of the first one must not turn a clean exit into death by signal."""
    port = free_port()
    service = ServiceProcess("tokenizer", ["tokenizer", "--host", "127.0.0.1", "--port", str(port),
                                           "--model-dir", str(model_dir)], f"127.0.0.1:{port}", tmp_path / "t.log")
    service.start()
    try:
        asyncio.run(wait_until_serving(service.address, timeout_s=60))
        service.process.send_signal(signal.SIGINT)  # what Ctrl-C sends the terminal's process group
        time.sleep(1.0)
        assert service.running
        asyncio.run(wait_until_serving(service.address, timeout_s=5))  # still serving
        while service.running:  # SIGTERM after SIGTERM, through the shutdown and the interpreter's exit
            service.process.send_signal(signal.SIGTERM)
            time.sleep(0.0001)
        assert service.process.wait() == 0, service.log_tail()
    finally:
        service.kill()


@pytest.mark.parametrize("command", [["serve", "--port", "70000"], ["serve", "--port", "0"],
                                     ["serve", "--metrics-port", "65536"], ["worker", "--port", "70000"],
                                     ["scheduler", "--metrics-port", "-1"], ["tokenizer", "--port", "65536"]])
def test_a_port_out_of_range_is_a_usage_error(command: list[str]) -> None:
    """gRPC would listen on the number modulo 65536; `serve` must also know its port (no 0)."""
    result = subprocess.run([sys.executable, "-m", "prefixcache.cli.main", *command],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{command[1]}: " in result.stderr and "must be in [" in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["serve", "--block-size", "3"], ["serve", "--hash-algo", "md5"],
                                     ["scheduler", "--tokenizer", "t:1", "--worker", "w:1", "--block-size", "0"]])
def test_cache_settings_are_checked_before_anything_starts(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "prefixcache.cli.main", *command],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"argument {command[-2]}: " in result.stderr, result.stderr


def test_a_failed_start_shows_this_runs_log_lines_only(tmp_path: Path) -> None:
    """A reused log directory keeps earlier runs' lines: the error shown must not quote them."""
    log = tmp_path / "tokenizer.log"
    log.write_text("an error from an earlier run\n")
    missing = tmp_path / "no-such-model"
    service = ServiceProcess("tokenizer", ["tokenizer", "--port", "0", "--model-dir", str(missing)], "", log)
    service.start()
    assert service.wait(timeout_s=60) == 1
    assert "earlier run" not in service.log_tail() and str(missing) in service.log_tail()
    assert "earlier run" in log.read_text()  # kept, not overwritten


def test_the_tokenizer_reports_a_model_dir_without_tokenizer_json_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "prefixcache.cli.main", "tokenizer", "--port", "0",
                             "--model-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"no tokenizer.json in {tmp_path}" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("prefixcache.tokenizer.server", ("torch", "triton", "transformers")),
        ("prefixcache.scheduler.server", ("torch", "triton", "transformers", "tokenizers", "jinja2")),
        ("prefixcache.cli.generate", ("torch", "triton", "transformers", "tokenizers")),
    ],
)
def test_service_images_import_only_what_they_install(module: str, forbidden: tuple[str, ...]) -> None:
    probe = f"import sys, {module}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"


def test_worker_refuses_a_bad_kv_cache_memory_before_loading_a_model(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", "worker", "--port", "0", "--kv-cache-memory", "12 apples",
         "--model-dir", str(tmp_path / "no-such-model")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--kv-cache-memory" in result.stderr and "12 apples" in result.stderr
    assert "no-such-model" not in result.stderr  # it never got as far as the model


@pytest.mark.slow
def test_worker_refuses_a_kv_cache_budget_beyond_free_memory(model_dir: Path) -> None:
    """Allocating it would end in the OOM killer, or an allocator error naming no setting."""
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", "worker", "--port", "0",
         "--kv-cache-memory", "1024TiB", "--model-dir", str(model_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "--kv-cache-memory: kv cache memory of 1125899906842624 bytes is more than the" in result.stderr


@pytest.mark.slow
def test_serve_stops_with_the_reason_when_the_kv_budget_holds_no_block(tmp_path: Path) -> None:
    """The worker refuses to initialize a cache without room for one block; the scheduler takes
    that for a setting to fix, not for a worker to wait for, and `serve` stops naming it."""
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", "serve", "--port", str(free_port()),
         "--kv-cache-memory", "100", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 1
    assert "the scheduler exited with status 1" in result.stderr
    assert "kv_cache_memory: kv cache memory budget of 100 bytes is below one block" in result.stderr


def test_the_engine_reports_not_serving_while_its_worker_is_replaced(model_dir: Path, tmp_path: Path) -> None:
    """Health of the Engine service follows the worker; the process's own ("") stays SERVING, so a
    liveness probe leaves the scheduler alone while a readiness probe on the Engine turns traffic away."""
    engine_service = "prefixcache.engine.v1.Engine"
    worker_port, engine_port, tokenizer_port = free_port(), free_port(), free_port()
    engine = f"127.0.0.1:{engine_port}"
    logs = [(tmp_path / name).open("wb") for name in ("worker-1.log", "scheduler.log", "tokenizer.log", "worker-2.log")]

    def start(log, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "prefixcache.cli.main", *args],
                                stdout=log, stderr=subprocess.STDOUT)

    def start_worker(log) -> subprocess.Popen:
        return start(log, "worker", "--host", "127.0.0.1", "--port", str(worker_port), "--model-dir", str(model_dir),
                     "--kv-cache-memory", "64MiB")

    async def engine_health(service: str) -> bool:
        async with open_channel(engine) as channel:
            return await is_serving(channel, service)

    async def until(service: str, serving: bool, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await engine_health(service) != serving:
            assert asyncio.get_running_loop().time() < deadline, f"{service or 'the process'} never became {serving}"
            await asyncio.sleep(0.1)

    async def generate_once() -> None:
        # The step on the dead worker is what reveals it.
        async with open_channel(engine) as channel:
            call = engine_pb2_grpc.EngineStub(channel).Generate(
                engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=[1, 2, 3])), timeout=30)
            with contextlib.suppress(grpc.RpcError):
                async for _ in call:
                    pass

    processes = [start_worker(logs[0]),
                 start(logs[1], "scheduler", "--host", "127.0.0.1", "--port", str(engine_port),
                       "--tokenizer", f"127.0.0.1:{tokenizer_port}", "--worker", f"127.0.0.1:{worker_port}"),
                 start(logs[2], "tokenizer", "--host", "127.0.0.1", "--port", str(tokenizer_port),
                       "--model-dir", str(model_dir))]
    try:
        asyncio.run(until(engine_service, True, timeout_s=120))
        asyncio.run(wait_until_serving(f"127.0.0.1:{tokenizer_port}", timeout_s=60))  # a token-id prompt's reply needs it
        processes[0].kill()
        processes[0].wait()
        asyncio.run(generate_once())
        asyncio.run(until(engine_service, False, timeout_s=30))
        assert asyncio.run(engine_health(""))
        processes.append(start_worker(logs[3]))
        asyncio.run(until(engine_service, True, timeout_s=120))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()


@pytest.mark.parametrize(("engine_host", "metrics_host"), [
    ("localhost", "localhost"), ("127.0.0.1", "127.0.0.1"), ("[::1]", "::1"),  # loopback stays loopback
    ("[::]", "0.0.0.0"), ("0.0.0.0", "0.0.0.0"),  # every interface: Prometheus scrapes the pod's IPv4 address
])
def test_metrics_listen_where_the_engine_api_does(engine_host: str, metrics_host: str) -> None:
    from prefixcache.rpc.metrics_http import metrics_address

    assert metrics_address(engine_host) == metrics_host


def test_a_service_that_never_serves_is_named_with_its_log(tmp_path: Path) -> None:
    """The scheduler waits for a worker nobody runs: it never reports SERVING, and waiting for it ends
    in an error naming it and quoting its log, not in a bare address."""
    from prefixcache.launcher import LocalPlatform, PlatformConfig

    platform = LocalPlatform(PlatformConfig(model_dir=tmp_path, log_dir=tmp_path, engine_port=free_port(),
                                            engine_host="127.0.0.1"))
    platform.scheduler.start()  # its tokenizer and worker addresses are free ports: nothing answers there
    try:
        with pytest.raises(RuntimeError) as failure:
            asyncio.run(platform.wait_serving(platform.scheduler, timeout_s=4))
        message = str(failure.value)
        assert message.startswith("the scheduler was not serving after 4 s; its log ends:\n")
        assert platform.worker.address in message  # the scheduler logs what it is waiting for
    finally:
        platform.scheduler.kill()


def test_a_taken_metrics_port_fails_the_scheduler_before_it_waits_for_a_worker() -> None:
    """The metrics port is bound first: taken, the scheduler exits at once and names the flag, rather
    than after a worker (here one that never answers) has loaded its model."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "prefixcache.cli.main", "scheduler", "--host",
                                 "127.0.0.1", "--port", str(free_port()), "--tokenizer", f"127.0.0.1:{free_port()}",
                                 "--worker", f"127.0.0.1:{free_port()}", "--metrics-port", str(metrics_port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"cannot serve metrics on 127.0.0.1:{metrics_port} (--metrics-port)" in result.stderr
    assert "waiting for the worker" not in result.stderr
    assert time.monotonic() - started < 30
