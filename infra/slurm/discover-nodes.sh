#!/usr/bin/env bash
# Print the SLURM compute nodes, one "NAME ADDRESS" pair per line.
#
# Two sources:
#   static      SLURM_NODES="n1:10.0.0.1 n2:10.0.0.2 n3" (ADDRESS defaults to NAME)
#   kubernetes  the pods of the slurmd StatefulSet, found by their stable DNS names behind the headless
#               Service: <statefulset>-<i>.<service>.<namespace>.svc.<cluster domain>. The Service sets
#               publishNotReadyAddresses, so names resolve as soon as the pods are scheduled.
# SLURM_DISCOVERY picks the source (default: kubernetes when SLURMD_STATEFULSET is set, else static).
set -euo pipefail

discovery=${SLURM_DISCOVERY:-}
if [ -z "$discovery" ]; then
  if [ -n "${SLURMD_STATEFULSET:-}" ]; then discovery=kubernetes; else discovery=static; fi
fi

static_nodes() {
  local entry
  for entry in ${SLURM_NODES:?SLURM_NODES must list the nodes (name[:address] ...)}; do
    printf '%s %s\n' "${entry%%:*}" "${entry#*:}"
  done
}

kubernetes_nodes() {
  local sts=${SLURMD_STATEFULSET:?} svc=${SLURMD_SERVICE:?} replicas=${SLURMD_REPLICAS:?}
  local ns=${POD_NAMESPACE:-default} domain=${CLUSTER_DOMAIN:-cluster.local}
  local wait_s=${DISCOVERY_WAIT_SECONDS:-300} i fqdn deadline
  deadline=$((SECONDS + wait_s))
  for ((i = 0; i < replicas; i++)); do
    fqdn="$sts-$i.$svc.$ns.svc.$domain"
    # Wait for the pod's DNS record so slurmctld can reach the node; after the deadline, list it
    # anyway (slurmctld marks it DOWN until it registers, ReturnToService=2 brings it back).
    until getent hosts "$fqdn" >/dev/null 2>&1 || ((SECONDS >= deadline)); do sleep 2; done
    getent hosts "$fqdn" >/dev/null 2>&1 || echo "discover-nodes: $fqdn does not resolve yet" >&2
    printf '%s %s\n' "$sts-$i" "$fqdn"
  done
}

case "$discovery" in
  static) static_nodes ;;
  kubernetes) kubernetes_nodes ;;
  *) echo "discover-nodes: unknown SLURM_DISCOVERY=$discovery (static|kubernetes)" >&2; exit 2 ;;
esac
