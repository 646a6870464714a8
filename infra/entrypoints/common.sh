#!/usr/bin/env bash
# Shared by the role entrypoints: start munged with the key from a mounted Secret, render slurm.conf.
# Sourced, not run. Paths are overridable so the same scripts work as root (slurmd) and non-root.

SCALARLM_INFRA=${SCALARLM_INFRA:-/opt/scalarlm/infra}
MUNGE_KEY_SOURCE=${MUNGE_KEY_SOURCE:-/etc/munge-secret/munge.key}
MUNGE_DIR=${MUNGE_DIR:-/run/munge}
export MUNGE_SOCKET=${MUNGE_SOCKET:-$MUNGE_DIR/munge.socket.2}

log() { echo "[$(date -u +%FT%TZ)] ${0##*/}: $*" >&2; }

# Start munged as the current user with a private copy of the shared key (munged refuses a key that
# others can read, and a Secret volume is owned by root). Waits until the socket answers.
start_munged() {
  if [ ! -s "$MUNGE_KEY_SOURCE" ]; then
    log "no munge key at $MUNGE_KEY_SOURCE (mount the chart's munge Secret there)"
    return 1
  fi
  mkdir -p "$MUNGE_DIR"
  chmod 0755 "$MUNGE_DIR"
  install -m 0400 "$MUNGE_KEY_SOURCE" "$MUNGE_DIR/munge.key"
  munged --force --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
  local i
  for i in $(seq 50); do
    munge -n --socket="$MUNGE_SOCKET" </dev/null >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "munged did not answer on $MUNGE_SOCKET"; cat "$MUNGE_DIR/munged.log" >&2 || true
  return 1
}

# Render slurm.conf (+ gres.conf, cgroup.conf) into SLURM_CONF_DIR and export SLURM_CONF for clients.
render_slurm_conf() {
  export SLURM_CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
  "$SCALARLM_INFRA/slurm/render-conf.sh"
  export SLURM_CONF="$SLURM_CONF_DIR/slurm.conf"
}

# Wait until a TCP port answers (bash's /dev/tcp), e.g. slurmd waiting for slurmctld.
wait_for_port() {
  local host=$1 port=$2 timeout=${3:-300} deadline=$((SECONDS + ${3:-300}))
  until (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; do
    if ((SECONDS >= deadline)); then log "$host:$port not reachable after ${timeout}s"; return 1; fi
    sleep 2
  done
}
