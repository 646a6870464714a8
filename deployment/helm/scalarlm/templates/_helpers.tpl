{{/* Names, labels and the pieces every pod shares. */}}

{{- define "scalarlm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "scalarlm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "scalarlm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "scalarlm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include "scalarlm.selectorLabels" (list . "api") */}}
{{- define "scalarlm.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "scalarlm.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "scalarlm.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{- define "scalarlm.apiUrl" -}}
{{- printf "http://%s-api:%d" (include "scalarlm.fullname" .) (int .Values.api.service.port) -}}
{{- end -}}

{{- define "scalarlm.workerUrl" -}}
{{- printf "http://%s-worker:%d" (include "scalarlm.fullname" .) (int .Values.worker.port) -}}
{{- end -}}

{{- define "scalarlm.pvcName" -}}
{{- default (printf "%s-shared" (include "scalarlm.fullname" .)) .Values.persistence.existingClaim -}}
{{- end -}}

{{- define "scalarlm.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "scalarlm.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The worker key (scope `worker`): the API and the workers present it to each other (server.worker_key_file). */}}
{{- define "scalarlm.workerKeySecret" -}}
{{- default (printf "%s-worker-key" (include "scalarlm.fullname" .)) .Values.auth.workerKeySecret -}}
{{- end -}}

{{- define "scalarlm.workerKeyEnv" -}}
- name: SCALARLM_WORKER_KEY_FILE
  value: /etc/scalarlm-worker-key/worker.key
{{- end -}}

{{- define "scalarlm.workerKeyMount" -}}
- name: worker-key
  mountPath: /etc/scalarlm-worker-key
  readOnly: true
{{- end -}}

{{- define "scalarlm.workerKeyVolume" -}}
- name: worker-key
  secret:
    secretName: {{ include "scalarlm.workerKeySecret" . }}
    defaultMode: 0440  # group-readable: non-root pods read it through fsGroup
{{- end -}}

{{- define "scalarlm.mungeSecret" -}}
{{- default (printf "%s-munge" (include "scalarlm.fullname" .)) .Values.munge.existingSecret -}}
{{- end -}}

{{/* The scalarlm settings YAML (scalarlm/config.py's Settings), rendered from values. */}}
{{- define "scalarlm.settings" -}}
{{- $server := dict "port" (int .Values.api.port) "api_url" (include "scalarlm.apiUrl" .) "worker_urls" (list (include "scalarlm.workerUrl" .)) "worker_port" (int .Values.worker.port) -}}
{{- $engine := dict "tensor_parallel_size" (int .Values.worker.tensorParallelSize) "gpu_memory_utilization" .Values.worker.gpuMemoryUtilization "max_num_seqs" (int .Values.worker.maxNumSeqs) "dtype" .Values.worker.dtype "enforce_eager" .Values.worker.enforceEager "enable_lora" .Values.worker.enableLora -}}
{{- if .Values.worker.maxModelLen -}}
{{- $_ := set $engine "max_model_len" (int .Values.worker.maxModelLen) -}}
{{- end -}}
{{- $training := dict "launcher" (ternary "slurm" "local" .Values.slurm.enabled) -}}
{{- if .Values.slurm.enabled -}}
{{- $_ := set $training "gpus_per_node" (int .Values.slurm.compute.gpusPerNode) -}}
{{- $_ := set $training "nodes" (int .Values.slurm.compute.replicas) -}}
{{- end -}}
{{- $settings := dict "model" .Values.model "home" .Values.persistence.mountPath "log_level" .Values.logLevel "server" $server "engine" $engine "training" $training -}}
{{- if .Values.servedModelName -}}
{{- $_ := set $settings "served_model_name" .Values.servedModelName -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $settings (deepCopy .Values.extraSettings)) -}}
{{- end -}}

{{/* Environment every scalarlm container gets: settings file, API keys, shared caches. */}}
{{- define "scalarlm.env" -}}
- name: SCALARLM_CONFIG
  value: /etc/scalarlm/settings.yaml
- name: SCALARLM_HOME
  value: {{ .Values.persistence.mountPath | quote }}
- name: SCALARLM_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "scalarlm.apiKeysSecret" . }}
      key: api-keys
- name: HF_HOME
  value: {{ printf "%s/hf-cache" .Values.persistence.mountPath | quote }}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/* Volumes every pod mounts: the shared RWX volume, the settings, the munge key. */}}
{{- define "scalarlm.volumes" -}}
- name: shared
  persistentVolumeClaim:
    claimName: {{ include "scalarlm.pvcName" . }}
- name: settings
  configMap:
    name: {{ include "scalarlm.fullname" . }}-settings
- name: munge-key
  secret:
    secretName: {{ include "scalarlm.mungeSecret" . }}
    defaultMode: 0440  # group-readable: non-root pods read it through fsGroup
{{- end -}}

{{- define "scalarlm.volumeMounts" -}}
- name: shared
  mountPath: {{ .Values.persistence.mountPath }}
- name: settings
  mountPath: /etc/scalarlm
  readOnly: true
- name: munge-key
  mountPath: /etc/munge-secret
  readOnly: true
{{- end -}}

{{/* An HTTP health probe: include "scalarlm.healthProbe" (dict "path" "/v1/health" "port" "http" "period" 10 "failures" 3) */}}
{{- define "scalarlm.healthProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
periodSeconds: {{ .period }}
timeoutSeconds: 5
failureThreshold: {{ .failures }}
{{- end -}}
