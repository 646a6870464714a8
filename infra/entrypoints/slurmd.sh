#!/usr/bin/env bash
# SLURM compute pod (one per StatefulSet replica): munged + slurmd in the foreground.
# slurmd must run as root to start jobs as their users (the job's processes are then the
# image's non-root `scalarlm` user, the same uid the control plane submits as). The node name
# is the pod name, which the StatefulSet keeps stable and discover-nodes.sh lists in slurm.conf.
set -euo pipefail
. "$(dirname "$0")/common.sh"

start_munged
render_slurm_conf
mkdir -p "${SLURM_SPOOL_DIR:-/var/spool/slurmd}" "${SLURM_RUN_DIR:-/run/slurm}" "${SLURM_LOG_DIR:-/var/log/slurm}"
node=${SLURMD_NODENAME:-$(hostname -s)}
wait_for_port "$SLURM_CONTROLLER_HOST" "${SLURM_CTLD_PORT:-6817}" "${SLURMCTLD_WAIT_SECONDS:-600}"
log "starting slurmd as node $node"
exec slurmd -D -N "$node" "$@"
