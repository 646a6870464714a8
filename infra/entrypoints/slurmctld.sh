#!/usr/bin/env bash
# SLURM controller pod: munged + slurmctld in the foreground. Its state directory lives on the
# StatefulSet's own volume so queued jobs survive a restart. Runs as root (it drops to SlurmUser).
set -euo pipefail
. "$(dirname "$0")/common.sh"

start_munged
render_slurm_conf
mkdir -p "${SLURM_STATE_DIR:-/var/spool/slurmctld}" "${SLURM_RUN_DIR:-/run/slurm}" "${SLURM_LOG_DIR:-/var/log/slurm}"
# A root-squashed NFS export refuses chown: keep going, slurmctld reports it if it cannot write.
chown -R "${SLURM_USER:-slurm}" "${SLURM_STATE_DIR:-/var/spool/slurmctld}" "${SLURM_LOG_DIR:-/var/log/slurm}" \
  || log "could not chown the state directory to ${SLURM_USER:-slurm}"
log "starting slurmctld for $(grep -c '^NodeName=' "$SLURM_CONF") nodes"
# -D: foreground (the container's main process); -i: ignore state that no longer matches the config.
exec slurmctld -D -i "$@"
