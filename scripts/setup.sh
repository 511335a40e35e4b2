#!/usr/bin/env bash
# Sets up .venv with every component and the embedded model. Idempotent: re-running after a change to
# the dependencies or the .proto files reinstalls; otherwise it returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}  # scripts/gpu_check.sh sets up its own beside it
STAMP=$VENV/.prefixcache-installed
fingerprint=$(cat pyproject.toml setup.py protos/prefixcache/protos/*/v1/*.proto 2>/dev/null | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$fingerprint" ]; then
  echo "==> installing dependencies (first time: a few minutes)"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch first and pinned: here this exact version is the CPU build on disk; anything looser pulls CUDA
  # wheels. On a machine without it, this is PyPI's CUDA 13 build (what scripts/gpu_check.sh wants).
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e ".[test]"
  echo "$fingerprint" > "$STAMP"
fi
# The four source roots of the `prefixcache` namespace (setup.py) as plain path entries, which every
# tool reads (import-linter, type checkers, editors), rather than only the editable install's import hook.
site_packages=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n' "$PWD/protos" "$PWD/services" "$PWD/kernels" "$PWD/operator" > "$site_packages/prefixcache-source-roots.pth"
echo "==> native CPU kernels (built once, then cached)"
"$VENV/bin/python" -c "from prefixcache.kernels.cpu.native import report; report()"
echo "==> embedded model"
"$VENV/bin/prefixcache" model pull
