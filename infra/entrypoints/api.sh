#!/usr/bin/env bash
# Control plane pod: `scalarlm serve --role api`. With the SLURM launcher it is also a SLURM client
# (sbatch/squeue/scancel), so it starts munged and renders slurm.conf first. Runs as the image's
# non-root user; settings come from the mounted YAML (SCALARLM_CONFIG) and SCALARLM_* env.
set -euo pipefail
. "$(dirname "$0")/common.sh"

# The paths match the slurmd pods' (/run/munge, /etc/slurm; the image lets uid 1000 write them): sbatch
# exports this environment, SLURM_CONF included, to the job, whose srun then runs on a slurmd pod.
if [ "${SCALARLM_TRAINING__LAUNCHER:-local}" = slurm ] || [ -n "${SLURM_CONTROLLER_HOST:-}" ]; then
  start_munged
  render_slurm_conf
fi
mkdir -p "${SCALARLM_HOME:-/data/scalarlm}"
exec scalarlm serve --role api --host "${SCALARLM_HOST:-0.0.0.0}" --port "${SCALARLM_PORT:-8000}" "$@"
