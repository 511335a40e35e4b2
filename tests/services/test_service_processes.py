"""Services as real processes: health, reflection, SIGTERM; and what each service's image must not need."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prefixcache.services.cli.launcher import free_port
from prefixcache.services.common.grpc_client import wait_until_serving


def test_tokenizer_process_serves_health_and_reflection_and_exits_0_on_sigterm(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "tokenizer.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.services.cli.main", "tokenizer", "--host", "127.0.0.1",
         "--port", str(port), "--model-dir", str(model_dir)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        asyncio.run(wait_until_serving(f"127.0.0.1:{port}", timeout_s=60, service="prefixcache.tokenizer.v1.Tokenizer"))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # the reflection client is synchronous
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"prefixcache.tokenizer.v1.Tokenizer", "grpc.health.v1.Health"} <= services
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert "shutting down" in (tmp_path / "tokenizer.log").read_text()


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("prefixcache.services.tokenizer.server", ("torch", "triton", "transformers")),
        ("prefixcache.services.scheduler.server", ("torch", "triton", "transformers", "tokenizers", "jinja2")),
        ("prefixcache.services.cli.generate", ("torch", "triton", "transformers", "tokenizers")),
    ],
)
def test_service_images_import_only_what_they_install(module: str, forbidden: tuple[str, ...]) -> None:
    probe = f"import sys, {module}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"


def test_worker_refuses_a_bad_kv_cache_memory_before_loading_a_model(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache.services.cli.main", "worker", "--port", "0", "--kv-cache-memory", "12 apples",
         "--model-dir", str(tmp_path / "no-such-model")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--kv-cache-memory" in result.stderr and "12 apples" in result.stderr
    assert "no-such-model" not in result.stderr  # it never got as far as the model
