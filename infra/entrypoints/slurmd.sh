#!/usr/bin/env bash
# SLURM compute pod (one per StatefulSet replica): munged + slurmd in the foreground.
# slurmd must run as root to start jobs as their users (the job's processes are then the
# image's non-root `scalarlm` user, the same uid the control plane submits as). The node name
# is the pod name, which the StatefulSet keeps stable and discover-nodes.sh lists in slurm.conf.
set -euo pipefail
. "$(dirname "$0")/common.sh"

# Jobs run as the image's `scalarlm` user with the groups /etc/group gives it. Let it open this node's
# GPU device files, whose group ids come from the host (AMD: video and render own /dev/kfd, /dev/dri).
grant_gpu_groups() {
  local dev gid group user=${SCALARLM_JOB_USER:-scalarlm}
  id "$user" >/dev/null 2>&1 || return 0
  for dev in /dev/kfd /dev/dri/renderD* /dev/nvidia[0-9]* /dev/nvidiactl; do
    [ -c "$dev" ] || continue
    gid=$(stat -c %g "$dev")
    [ "$gid" != 0 ] || continue
    getent group "$gid" >/dev/null || groupadd -g "$gid" "gpu$gid"
    group=$(getent group "$gid" | cut -d: -f1)
    usermod -aG "$group" "$user" || log "could not add $user to $group ($dev)"
  done
}

start_munged
render_slurm_conf
grant_gpu_groups
mkdir -p "${SLURM_SPOOL_DIR:-/var/spool/slurmd}" "${SLURM_RUN_DIR:-/run/slurm}" "${SLURM_LOG_DIR:-/var/log/slurm}"
node=${SLURMD_NODENAME:-$(hostname -s)}
wait_for_port "$SLURM_CONTROLLER_HOST" "${SLURM_CTLD_PORT:-6817}" "${SLURMCTLD_WAIT_SECONDS:-600}"
log "starting slurmd as node $node"
exec slurmd -D -N "$node" "$@"
