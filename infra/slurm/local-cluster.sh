#!/usr/bin/env bash
# A real one-node SLURM cluster on loopback, in one scratch directory, for CI and laptops.
#
#   local-cluster.sh start DIR   (re)start munged, slurmctld and slurmd; prints `export SLURM_CONF=...`
#   local-cluster.sh stop DIR    stop the daemons started in DIR (by their pid files)
#
# Runs as the calling user: as root (CI) slurmd can run jobs for any user; as another user the
# daemons and the jobs all run as that user. Needs the Debian packages
# `slurmctld slurmd slurm-client munge`. No systemd: the daemons are started directly, with their
# own munge key, socket and pid files under DIR, so nothing touches /etc or a system munged.
# Authentication is munge, as in production. Node and controller are both `localhost` (127.0.0.1).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:?usage: local-cluster.sh start|stop DIR}
base=$(mkdir -p "${2:?usage: local-cluster.sh start|stop DIR}" && cd "$2" && pwd)
port_base=${SLURM_PORT_BASE:-16817}

pid_of() { [ -s "$1" ] && cat "$1" || true; }

stop_pid() {  # stop_pid PIDFILE: TERM, wait up to 10 s, then KILL
  local pid
  pid=$(pid_of "$1")
  [ -n "$pid" ] || return 0
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

# Processes of this cluster's jobs (slurmstepd and the tasks it started) outlive slurmd: find them by
# the SLURM_CONF they inherited from slurmd or sbatch, and stop them too.
job_pids() {
  local conf="SLURM_CONF=$base/etc/slurm.conf" env pid
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}; pid=${pid%/environ}
    [ "$pid" != $$ ] || continue
    grep -qzxF "$conf" "$env" 2>/dev/null || continue
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmstepd ] || grep -qz '^SLURM_JOB_ID=' "$env" 2>/dev/null; then
      echo "$pid"
    fi
  done
}

stop() {
  local jobs pids ctld
  ctld=$(pid_of "$base/run/slurmctld.pid")
  if [ -n "$ctld" ] && kill -0 "$ctld" 2>/dev/null && [ -f "$base/etc/slurm.conf" ]; then
    # Cancel what is still queued or running, so slurmstepd cleans up while slurmd is alive.
    jobs=$(SLURM_CONF="$base/etc/slurm.conf" squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      SLURM_CONF="$base/etc/slurm.conf" scancel $jobs 2>/dev/null || true
      for _ in $(seq 100); do
        [ -z "$(SLURM_CONF="$base/etc/slurm.conf" squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.1
      done
    fi
  fi
  stop_pid "$base/run/slurmd-localhost.pid"
  stop_pid "$base/run/slurmctld.pid"
  stop_pid "$base/munge/munged.pid"
  pids=$(job_pids)
  if [ -n "$pids" ]; then
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    sleep 1
    # shellcheck disable=SC2086
    kill -KILL $(job_pids) 2>/dev/null || true
  fi
}

alive() {  # alive PIDFILE NAME: fail fast when a daemon died after forking (they exit 0 anyway)
  local pid
  pid=$(pid_of "$1")
  # A daemon writes its pid file a moment after forking: give it 10 s before calling it dead.
  [ -z "$pid" ] && ((SECONDS < started + 10)) && return 0
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
    echo "local-cluster: $2 is not running; its log:" >&2
    tail -n 20 "$base/log/$2.log" >&2 2>/dev/null || true
    return 1
  fi
}

start() {
  stop
  rm -rf "$base/state" "$base/spool" "$base/run" "$base/log" "$base/etc" "$base/pmix"
  mkdir -p "$base/state" "$base/spool" "$base/run" "$base/log" "$base/etc" "$base/munge"
  chmod 700 "$base/munge"
  [ -s "$base/munge/munge.key" ] || mungekey --create --keyfile="$base/munge/munge.key" 2>/dev/null \
    || { dd if=/dev/urandom of="$base/munge/munge.key" bs=1 count=1024 status=none; }
  chmod 600 "$base/munge/munge.key"
  # --force: pytest's temp dirs are 0700, which munged otherwise refuses for its socket.
  munged --force --key-file="$base/munge/munge.key" --socket="$base/munge/munge.socket.2" \
    --pid-file="$base/munge/munged.pid" --log-file="$base/log/munged.log" \
    --seed-file="$base/munge/munged.seed"

  # CPUs and layout as slurmd sees them; RealMemory at 90% so the node never goes "Low RealMemory".
  local hw cpus mem
  hw=$(slurmd -C | head -n 1)
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  SLURM_CONF_DIR="$base/etc" SLURM_CLUSTER_NAME=ci SLURM_CONTROLLER_HOST=localhost \
    SLURM_CONTROLLER_ADDR=127.0.0.1 SLURM_CTLD_PORT=$port_base SLURM_SLURMD_PORT=$((port_base + 1)) \
    MUNGE_SOCKET="$base/munge/munge.socket.2" SLURM_USER="$(id -un)" SLURM_SLURMD_USER="$(id -un)" SLURM_STATE_DIR="$base/state" \
    SLURM_SPOOL_DIR="$base/spool" SLURM_RUN_DIR="$base/run" SLURM_LOG_DIR="$base/log" \
    SLURM_PMIX_TMPDIR="$base/pmix" \
    SLURM_KILL_WAIT=5 SLURM_PARTITION=debug SLURM_DISCOVERY=static SLURM_NODES=localhost:127.0.0.1 \
    SLURM_NODE_CPUS="$cpus" SLURM_NODE_MEMORY_MB=$((mem * 9 / 10)) SLURM_GPU_KIND=none \
    "$here/render-conf.sh" >/dev/null

  export SLURM_CONF="$base/etc/slurm.conf"
  started=$SECONDS
  slurmctld
  slurmd -N localhost
  local deadline=$((SECONDS + ${SLURM_START_TIMEOUT:-30})) state=""
  while ((SECONDS < deadline)); do
    alive "$base/munge/munged.pid" munged && alive "$base/run/slurmctld.pid" slurmctld \
      && alive "$base/run/slurmd-localhost.pid" slurmd-localhost || { stop; return 1; }
    state=$(sinfo -h -o %T 2>/dev/null || true)
    if [ "$state" = idle ]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.1
  done
  echo "local-cluster: node not idle after ${SLURM_START_TIMEOUT:-30}s (state: ${state:-none})" >&2
  stop
  return 1
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: local-cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
