"""The tokenizer as its image runs it: a process with only the `tokenizer` extra's packages in use. It
serves a model directory, the default one under $PREFIXCACHE_HOME unless told another, and never
converts one (that needs the worker's packages)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from grpc import aio

from prefixcache.launcher import free_port
from prefixcache.model_store.store import default_model_dir
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2 as pb
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from prefixcache.rpc.client import wait_until_serving

# What converting a model or running one would import; the tokenizer image has none of them.
NOT_IN_THE_TOKENIZER_IMAGE = {"torch", "triton", "transformers", "gguf", "safetensors", "numpy"}


def tokenizer_process(home: Path, *args: str) -> subprocess.Popen:
    """`prefixcache tokenizer` with $PREFIXCACHE_HOME at `home`, noting every module it imports."""
    command = [sys.executable, "-X", "importtime", "-m", "prefixcache.cli.main", "tokenizer", *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PREFIXCACHE_HOME": str(home)})


def imported_packages(stderr: str) -> set[str]:
    """Top-level packages from `-X importtime` lines (`import time: self | cumulative | name`)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:")}


def test_without_a_pulled_model_it_stops_at_once_saying_how_to_get_one(tmp_path: Path) -> None:
    process = tokenizer_process(tmp_path, "--port", "0")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    [message] = [line for line in stderr.splitlines() if not line.startswith("import time:")]
    assert message.endswith(f"no model in {default_model_dir(tmp_path)}: run `prefixcache model pull` first, "
                            "or give --model-dir")
    assert list(tmp_path.iterdir()) == []  # nothing downloaded, nothing converted
    assert not imported_packages(stderr) & NOT_IN_THE_TOKENIZER_IMAGE


def test_it_serves_the_pulled_default_model_with_the_tokenizer_extra_alone(model_dir: Path, tmp_path: Path) -> None:
    default_model_dir(tmp_path).parent.mkdir(parents=True)
    default_model_dir(tmp_path).symlink_to(model_dir)  # as `prefixcache model pull` leaves it
    port = free_port()
    process = tokenizer_process(tmp_path, "--host", "127.0.0.1", "--port", str(port))

    async def tokenize() -> list[int]:
        await wait_until_serving(f"127.0.0.1:{port}", timeout_s=60)
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return list((await pb_grpc.TokenizerStub(channel).Tokenize(pb.TokenizeRequest(text="Hello"))).token_ids)

    try:
        assert asyncio.run(tokenize()) == [19556]
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    imported = imported_packages(stderr)
    assert "tokenizers" in imported and not imported & NOT_IN_THE_TOKENIZER_IMAGE
