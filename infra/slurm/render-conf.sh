#!/usr/bin/env bash
# Render slurm.conf, gres.conf and cgroup.conf into SLURM_CONF_DIR from the templates next to this file.
#
# Every setting comes from the environment (the Helm chart sets them from values; local-cluster.sh
# sets them for the loopback cluster). The node list comes from discover-nodes.sh unless
# SLURM_NODE_LINES is given verbatim (heterogeneous clusters).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

export SLURM_CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
export SLURM_CLUSTER_NAME=${SLURM_CLUSTER_NAME:-scalarlm}
export SLURM_CONTROLLER_HOST=${SLURM_CONTROLLER_HOST:?SLURM_CONTROLLER_HOST names the slurmctld host}
export SLURM_CONTROLLER_ADDR=${SLURM_CONTROLLER_ADDR:-}
export SLURM_CTLD_PORT=${SLURM_CTLD_PORT:-6817}
export SLURM_SLURMD_PORT=${SLURM_SLURMD_PORT:-6818}
export MUNGE_SOCKET=${MUNGE_SOCKET:-/run/munge/munge.socket.2}
export SLURM_USER=${SLURM_USER:-slurm}
export SLURM_SLURMD_USER=${SLURM_SLURMD_USER:-root}
export SLURM_STATE_DIR=${SLURM_STATE_DIR:-/var/spool/slurmctld}
export SLURM_SPOOL_DIR=${SLURM_SPOOL_DIR:-/var/spool/slurmd}
export SLURM_RUN_DIR=${SLURM_RUN_DIR:-/run/slurm}
export SLURM_LOG_DIR=${SLURM_LOG_DIR:-/var/log/slurm}
export SLURM_PROCTRACK=${SLURM_PROCTRACK:-proctrack/linuxproc}
export SLURM_TASK_PLUGIN=${SLURM_TASK_PLUGIN:-task/none}
export SLURM_KILL_WAIT=${SLURM_KILL_WAIT:-30}
export SLURM_MPI_DEFAULT=${SLURM_MPI_DEFAULT:-none}
export SLURM_PARTITION=${SLURM_PARTITION:-train}
export SLURM_EXTRA=${SLURM_EXTRA:-}
node_cpus=${SLURM_NODE_CPUS:-1}
node_memory=${SLURM_NODE_MEMORY_MB:-1024}
node_gpus=${SLURM_NODE_GPUS:-0}
gpu_kind=${SLURM_GPU_KIND:-none}              # none | nvidia | amd
gres_autodetect=${SLURM_GRES_AUTODETECT:-no}  # yes: AutoDetect=nvml / rsmi (needs a SLURM built with it)
dev_dir=${SLURM_DEV_DIR:-/dev}                # where this node's GPU device files are

export SLURM_CONTROLLER_ADDR_SUFFIX=""
[ -n "$SLURM_CONTROLLER_ADDR" ] && SLURM_CONTROLLER_ADDR_SUFFIX="($SLURM_CONTROLLER_ADDR)"

case "$gpu_kind" in none | nvidia | amd) ;; *)
  echo "render-conf: SLURM_GPU_KIND=$gpu_kind (none|nvidia|amd)" >&2; exit 2 ;;
esac
if [ "$gpu_kind" = none ]; then node_gpus=0; fi

node_lines() {
  local name addr gres=""
  ((node_gpus > 0)) && gres=" Gres=gpu:$node_gpus"
  while read -r name addr; do
    [ -n "$name" ] || continue
    printf 'NodeName=%s NodeAddr=%s CPUs=%s RealMemory=%s%s %sState=UNKNOWN\n' \
      "$name" "${addr:-$name}" "$node_cpus" "$node_memory" "$gres" "${SLURM_NODE_EXTRA:+$SLURM_NODE_EXTRA }"
  done
}

# Device files of this node's GPUs: the ones present (a pod sees only its own), else 0..N-1.
gpu_files() {
  local pattern first
  if [ "$gpu_kind" = nvidia ]; then pattern="$dev_dir/nvidia[0-9]*"; first=0; else pattern="$dev_dir/dri/renderD*"; first=128; fi
  local found=() f
  for f in $pattern; do [ -c "$f" ] && found+=("$f"); done
  if ((${#found[@]} > 0)); then
    printf 'Name=gpu File=%s\n' "${found[@]:0:$node_gpus}"
  elif [ "$gpu_kind" = nvidia ]; then
    printf 'Name=gpu File=/dev/nvidia[%d-%d]\n' "$first" $((first + node_gpus - 1))
  else
    printf 'Name=gpu File=/dev/dri/renderD[%d-%d]\n' "$first" $((first + node_gpus - 1))
  fi
}

gres_lines() {
  if ((node_gpus == 0)); then echo "# no GPUs on these nodes"; return; fi
  if [ "$gres_autodetect" = yes ]; then
    if [ "$gpu_kind" = nvidia ]; then echo "AutoDetect=nvml"; else echo "AutoDetect=rsmi"; fi
  fi
  gpu_files
}

if [ -z "${SLURM_NODE_LINES:-}" ]; then
  SLURM_NODE_LINES=$("$here/discover-nodes.sh" | node_lines)
fi
export SLURM_NODE_LINES
SLURM_GRES_LINES=$(gres_lines)
export SLURM_GRES_LINES

vars='${SLURM_CLUSTER_NAME} ${SLURM_CONTROLLER_HOST} ${SLURM_CONTROLLER_ADDR_SUFFIX} ${SLURM_CTLD_PORT}
${SLURM_SLURMD_PORT} ${MUNGE_SOCKET} ${SLURM_USER} ${SLURM_SLURMD_USER} ${SLURM_STATE_DIR} ${SLURM_SPOOL_DIR} ${SLURM_RUN_DIR}
${SLURM_LOG_DIR} ${SLURM_PROCTRACK} ${SLURM_TASK_PLUGIN} ${SLURM_KILL_WAIT} ${SLURM_MPI_DEFAULT}
${SLURM_PARTITION} ${SLURM_EXTRA} ${SLURM_NODE_LINES} ${SLURM_GRES_LINES}'
mkdir -p "$SLURM_CONF_DIR"
envsubst "$vars" <"$here/slurm.conf.tmpl" >"$SLURM_CONF_DIR/slurm.conf.new"
envsubst "$vars" <"$here/gres.conf.tmpl" >"$SLURM_CONF_DIR/gres.conf.new"
cp "$here/cgroup.conf" "$SLURM_CONF_DIR/cgroup.conf.new"
# mpi.conf: where srun --mpi=pmix puts each step's client directory (default: /tmp, named by uid and
# job id, so two clusters on one host, or a stale directory from a killed step, would collide).
if [ -n "${SLURM_PMIX_TMPDIR:-}" ]; then
  mkdir -p "$SLURM_PMIX_TMPDIR"
  printf 'PMIxCliTmpDirBase=%s\n' "$SLURM_PMIX_TMPDIR" >"$SLURM_CONF_DIR/mpi.conf.new"
  mv -f "$SLURM_CONF_DIR/mpi.conf.new" "$SLURM_CONF_DIR/mpi.conf"
fi
for f in slurm.conf gres.conf cgroup.conf; do mv -f "$SLURM_CONF_DIR/$f.new" "$SLURM_CONF_DIR/$f"; done
echo "render-conf: wrote $SLURM_CONF_DIR/slurm.conf ($(grep -c '^NodeName=' "$SLURM_CONF_DIR/slurm.conf") nodes)"
