#!/usr/bin/env bash
# Control plane pod: `scalarlm serve --role api`. With the SLURM launcher it is also a SLURM client
# (sbatch/squeue/scancel), so it starts munged and renders slurm.conf first. Runs as the image's
# non-root user; settings come from the mounted YAML (SCALARLM_CONFIG) and SCALARLM_* env.
set -euo pipefail
. "$(dirname "$0")/common.sh"

if [ "${SCALARLM_TRAINING__LAUNCHER:-local}" = slurm ] || [ -n "${SLURM_CONTROLLER_HOST:-}" ]; then
  export MUNGE_DIR=${MUNGE_DIR:-$HOME/.munge} SLURM_CONF_DIR=${SLURM_CONF_DIR:-$HOME/.slurm}
  export MUNGE_SOCKET=$MUNGE_DIR/munge.socket.2
  start_munged
  render_slurm_conf
fi
mkdir -p "${SCALARLM_HOME:-/data/scalarlm}"
exec scalarlm serve --role api --host "${SCALARLM_HOST:-0.0.0.0}" --port "${SCALARLM_PORT:-8000}" "$@"
