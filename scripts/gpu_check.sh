#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): scalarlm's trainer on CUDA in bf16 beside HF Trainer, one JSON line.
#
#   scripts/gpu_check.sh fetch    # where PyPI is reachable: the wheels a bare GPU machine lacks -> .whl/
#   scripts/gpu_check.sh [ARGS]   # on the GPU machine (no network): install .whl/ into /tmp/site, run the check
#
# The GPU machine needs only Python 3.12 with CUDA torch and transformers (>=5.16.1); .whl/ brings
# megatron-core 0.16.1 (the release every stack pins), pydantic (the trainer's job schema) and scalarlm itself.
# No vLLM: the check covers the trainer. ARGS go to `python -m bench.gpu_check` (--steps, --batch, --seq-len, ...).
# Without a CUDA device it prints a line saying so and exits 0. See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=.whl
SITE=${GPU_CHECK_SITE:-/tmp/site}
# Exact versions, as the development venv runs them (pydantic's own needs included: --no-deps installs).
PINS=(megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)

if [ "${1:-}" = fetch ]; then
  mkdir -p "$WHEELS"
  exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"  # never committed
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "${PINS[@]}"
  rm -f "$WHEELS"/scalarlm-*.whl
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" .
  ls -l "$WHEELS"
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo '{"ok": false, "skipped": "GPU check skipped: no CUDA device visible to torch (or no torch)"}'
  exit 0
fi
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# bench/ is not in the wheel: run it from this checkout (the trainer it starts imports scalarlm from $SITE or here).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m bench.gpu_check "$@"
