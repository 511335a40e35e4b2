#!/usr/bin/env bash
# The GPU path end to end, on a machine with an NVIDIA GPU, this repository checked out and the package
# index reachable; then one summary table. Under 8 minutes on one GPU, most of it the install.
#
#   install  a virtual environment (.venv-gpu) with the CUDA build of torch and `.[test]` (scripts/setup.sh);
#            PyPI's torch 2.13.0 is built for CUDA 13 (driver 580+): on an older driver the CUDA 12.8
#            build comes from PyTorch's index instead (TORCH_INDEX overrides either choice)
#   model    pull and convert the embedded model
#   tests    the kernel tests and the model tests on the device (tests/kernels; the model tests' CUDA runs)
#   kernels  benchmarks/kernels_cuda.py: the Triton kernels against the reference and torch SDPA
#   serve    `prefixcache serve` on the device in float32 and in bfloat16; greedy tokens of three chat
#            prompts, cold and cached, against the CPU float32 path in process (float32: identical;
#            bfloat16: the first 8 tokens, the tolerance of docs/gpu.md)
#   bench    a short `prefixcache bench` against the server of the device's default dtype
#
#   scripts/gpu_check.sh                 # on the GPU machine
#   scripts/gpu_check.sh --device cpu    # every step on the CPU path, in .venv: no CUDA install
# PYTHON=path/to/python skips the install and runs the rest with that environment (on a GPU machine
# without the package index, one holding the CUDA build of torch and `.[test]`).
# Logs stay in $GPU_CHECK_DIR (default: a new temporary directory). Exit status 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs cpu or cuda}; fi
case $DEVICE in cuda|cpu) ;; *) echo "usage: $0 [--device cuda|cpu]" >&2; exit 2 ;; esac
WORK=${GPU_CHECK_DIR:-$(mktemp -d -t prefixcache-gpu-check.XXXXXX)}
mkdir -p "$WORK"
# The checkout's code, whatever the environment's own path entries say.
export PYTHONPATH="$ROOT/protos:$ROOT/services:$ROOT/kernels:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"

NAMES=() RESULTS=() SECONDS_TAKEN=() DETAILS=()
FAILED=0

# step NAME COMMAND...: runs it with its output shown and kept in $WORK/NAME.log, and records the row.
# The row's detail is the log's last line that starts with "detail: ", else its last line.
step() {
  local name=$1; shift
  local log="$WORK/$name.log" start=$SECONDS
  echo; echo "==> $name"
  "$@" 2>&1 | tee "$log"
  local status=${PIPESTATUS[0]}
  local detail
  detail=$(grep '^detail: ' "$log" | tail -n 1 | cut -c9-)
  [ -n "$detail" ] || detail=$(grep -v '^\s*$' "$log" | tail -n 1)
  NAMES+=("$name") SECONDS_TAKEN+=($((SECONDS - start))) DETAILS+=("${detail:0:120}")
  if [ "$status" -eq 0 ]; then RESULTS+=(ok); else RESULTS+=("FAILED ($status)"); FAILED=1; fi
  return "$status"
}

skip() {
  NAMES+=("$1") RESULTS+=(skipped) SECONDS_TAKEN+=(0) DETAILS+=("$2")
}

install_cuda_environment() {
  local driver index=${TORCH_INDEX:-}
  driver=$(nvidia-smi --query-gpu=driver_version,name --format=csv,noheader 2>/dev/null | head -n 1)
  echo "GPU: ${driver:-none found by nvidia-smi}"
  if [ -z "$index" ] && [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ]; then
    index=https://download.pytorch.org/whl/cu128  # CUDA 12.8 runs on drivers from 525 on
    echo "driver below 580: the CUDA 12.8 build of torch, from $index"
  fi
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || return 1
  if [ -n "$index" ]; then
    "$VENV/bin/pip" install -q --index-url "$index" torch==2.13.0 || return 1
  fi
  VENV=$VENV scripts/setup.sh || return 1
  "$PY" -c "import torch; assert torch.version.cuda, 'a CPU build of torch was installed'; \
print(f'detail: torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}')"
}

write_serve_check() {
  cat > "$WORK/serve_check.py" <<'PYTHON'
"""Greedy tokens of three chat prompts from a served Engine, cold then cached, against the CPU float32 path."""
import asyncio
import json
import sys
from pathlib import Path

from prefixcache.client import Completion, EngineClient, build_request
from prefixcache.model_store.store import ensure_default_model
from prefixcache.tokenizer.text import ChatTurn, TextTokenizer

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea in 2024.",
             "List three prime numbers and explain why each one is prime.")
MAX_TOKENS = 16
BFLOAT16_AGREEING_TOKENS = 8  # docs/gpu.md: bfloat16's tolerance against float32


def prompts() -> list[list[int]]:
    tokenizer = TextTokenizer(ensure_default_model())
    return [tokenizer.encode_chat([ChatTurn("user", question)]) for question in QUESTIONS]


def reference(path: Path) -> list[list[int]]:
    """The CPU float32 path, in process (computed once, then read back)."""
    if not path.exists():
        from prefixcache.llm import LLM, SamplingOptions

        with LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB") as llm:
            completions = llm.generate(prompts(), SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))
        path.write_text(json.dumps([completion.token_ids for completion in completions]))
    return json.loads(path.read_text())


async def served(target: str) -> tuple[list[list[int]], int]:
    """Each prompt's tokens (asked twice: the second time from the cache), and the cached prompt tokens."""
    tokens, cached = [], 0
    async with EngineClient(target) as engine:
        for prompt in prompts():
            runs = []
            for _ in range(2):
                completion = Completion()
                async for chunk in engine.generate(build_request(token_ids=prompt, max_tokens=MAX_TOKENS,
                                                                 temperature=0.0), timeout_s=600):
                    completion.add(chunk)
                runs.append(completion.token_ids)
            cached += completion.usage.cached_tokens
            tokens.append(runs)
    return tokens, cached


def main(target: str, dtype: str, reference_path: str) -> int:
    expected = reference(Path(reference_path))
    tokens, cached = asyncio.run(served(target))
    keep = None if dtype == "float32" else BFLOAT16_AGREEING_TOKENS
    agree = all(run[:keep] == want[:keep] for runs, want in zip(tokens, expected) for run in runs)
    matched = sum(len(want[:keep]) for want in expected)
    verdict = "identical" if keep is None else f"first {keep} tokens identical"
    print(json.dumps({"expected": expected, "served": tokens}))
    print(f"detail: {dtype}: {verdict if agree else 'DIFFERENT'} to the CPU float32 path "
          f"({matched} tokens, cold and cached; {cached} prompt tokens cached)")
    return 0 if agree and cached > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
PYTHON
}

free_port() {
  "$PY" -c "from prefixcache.launcher import free_port; print(free_port())"
}

# serve_and_check DTYPE [bench]: a served platform on $DEVICE in DTYPE, checked, optionally benchmarked.
serve_and_check() {
  local dtype=$1 bench=${2:-}
  local port log="$WORK/serve-$dtype.out" pid status=0
  port=$(free_port)
  "$PY" -m prefixcache.cli.main serve --device "$DEVICE" --dtype "$dtype" --host 127.0.0.1 --port "$port" \
    --kv-cache-memory 1GiB --log-dir "$WORK/serve-$dtype-logs" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q "Engine API serving" "$log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if grep -q "Engine API serving" "$log"; then
    step "serve $DEVICE $dtype" "$PY" "$WORK/serve_check.py" "127.0.0.1:$port" "$dtype" "$WORK/cpu-float32.json" \
      || status=1
    if [ -n "$bench" ]; then
      step "bench $DEVICE $dtype" bench_against "127.0.0.1:$port" || status=1
    fi
  else
    cat "$log"
    NAMES+=("serve $DEVICE $dtype") RESULTS+=("FAILED") SECONDS_TAKEN+=(0) DETAILS+=("did not start: $log")
    FAILED=1 status=1
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  return $status
}

bench_against() {
  "$PY" -m prefixcache.cli.main bench --target "$1" --workload shared-system-prompt --num-requests 8 \
    --concurrency 4 --prefix-len 512 --suffix-len 32:64 --output-len 16 --warmup 1 --no-progress \
    --json "$WORK/bench.json" || return 1
  "$PY" -c "import json; s = json.load(open('$WORK/bench.json'))['workloads']['shared-system-prompt']['cache']; \
print(f\"detail: {s['requests_per_s']:.2f} req/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, hit rate {s['hit_rate'] or 0:.0%}\")"
}

# The kernel tests (Triton compiled on a GPU, interpreted on CPU), then the model tests' runs on $DEVICE.
pytest_on_device() {
  local selection=(-m cuda) kernels models status
  [ "$DEVICE" = cpu ] && selection=(-m "not cuda" -k cpu)
  "$PY" -m pytest -q -p no:cacheprovider tests/kernels | tee "$WORK/pytest-kernels.out"
  status=${PIPESTATUS[0]}
  "$PY" -m pytest -q -p no:cacheprovider "${selection[@]}" tests/worker/test_model_on_devices.py \
    tests/worker/test_model_equivalence.py | tee "$WORK/pytest-models.out"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  kernels=$(tail -n 1 "$WORK/pytest-kernels.out") models=$(tail -n 1 "$WORK/pytest-models.out")
  echo "detail: kernels ${kernels//=/}; models ${models//=/}"
  return "$status"
}

echo "prefixcache GPU check on $DEVICE; logs in $WORK"
if [ "$DEVICE" = cuda ] && [ -z "${PYTHON:-}" ]; then
  VENV=${GPU_CHECK_VENV:-.venv-gpu}
  PY=$ROOT/$VENV/bin/python
  step install install_cuda_environment
else
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  skip install "--device $DEVICE: the environment of $PY, no CUDA install"
fi
if [ "$FAILED" -eq 0 ]; then
  DEFAULT_DTYPE=$("$PY" -c "import torch; from prefixcache.worker.loader import resolve_dtype; \
print(resolve_dtype('auto', torch.device('$DEVICE')))")
  step model "$PY" -m prefixcache.cli.main model pull
  step tests pytest_on_device
  step kernels "$PY" benchmarks/kernels_cuda.py --device "$DEVICE"
  write_serve_check
  for dtype in float32 bfloat16; do
    serve_and_check "$dtype" "$([ "$dtype" = "$DEFAULT_DTYPE" ] && echo bench)"
  done
else
  skip "the other steps" "the install failed"
fi

echo
echo "prefixcache GPU check on $DEVICE ($(date -u +%Y-%m-%dT%H:%MZ)); logs in $WORK"
printf '%-22s %-12s %7s  %s\n' step result seconds detail
printf '%-22s %-12s %7s  %s\n' ---- ------ ------- ------
for i in "${!NAMES[@]}"; do
  printf '%-22s %-12s %7s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${DETAILS[$i]}"
done
exit $FAILED
