#!/usr/bin/env bash
# Inference worker pod: `scalarlm serve --role worker`. It pulls work from the control plane
# (SCALARLM_SERVER__API_URL) and serves the OpenAI routes on settings.server.worker_port (8001)
# for the control plane to forward to. Runs as the image's non-root user.
set -euo pipefail
. "$(dirname "$0")/common.sh"

api_url=${SCALARLM_SERVER__API_URL:?SCALARLM_SERVER__API_URL names the control plane}
# vLLM compiles kernels and caches weights under HOME; keep them on the pod's own disk.
export HOME=${HOME:-/home/scalarlm}
exec scalarlm serve --role worker --api-url "$api_url" --host "${SCALARLM_HOST:-0.0.0.0}" "$@"
