{{/* Chart name, overridable. */}}
{{- define "polyroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified app name: <release>-<chart> (or the release name alone when it already contains
the chart name). Truncated to 63 chars minus room for the "-local"/"-qdrant"/"-redis" suffixes.
*/}}
{{- define "polyroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 56 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 56 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 56 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "polyroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Standard labels shared by every object; pass a dict {ctx, component}. */}}
{{- define "polyroute.labels" -}}
helm.sh/chart: {{ include "polyroute.chart" .ctx }}
{{ include "polyroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: polyroute
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels (immutable on Deployments): name, instance, component. */}}
{{- define "polyroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "polyroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "polyroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "polyroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "polyroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{- define "polyroute.configName" -}}{{ include "polyroute.fullname" . }}-config{{- end -}}
{{- define "polyroute.secretName" -}}{{ include "polyroute.fullname" . }}-keys{{- end -}}
{{- define "polyroute.redisName" -}}{{ include "polyroute.fullname" . }}-redis{{- end -}}
{{- define "polyroute.qdrantName" -}}{{ include "polyroute.fullname" . }}-qdrant{{- end -}}
{{- define "polyroute.localName" -}}{{ include "polyroute.fullname" . }}-local{{- end -}}

{{/* Whether the gateway has Redis (external URL, URL in a Secret, or the in-chart one). */}}
{{- define "polyroute.hasRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The REDIS_URL env entry (list items at column 0), shared by the gateway and the retrain CronJob. */}}
{{- define "polyroute.redisEnv" -}}
{{- if .Values.redis.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.existingSecret | quote }}, key: {{ .Values.redis.existingSecretKey | quote }}}
{{- else if .Values.redis.url }}
- {name: REDIS_URL, value: {{ .Values.redis.url | quote }}}
{{- else if .Values.redis.enabled }}
- {name: REDIS_URL, value: {{ printf "redis://%s:%d/0" (include "polyroute.redisName" .) (int .Values.redis.port) | quote }}}
{{- end }}
{{- end -}}

{{/* Whether the PodDisruptionBudget is rendered: "auto" means replicas > 1 or autoscaling. */}}
{{- define "polyroute.pdbEnabled" -}}
{{- $setting := toString .Values.podDisruptionBudget.enabled -}}
{{- if eq $setting "true" -}}true
{{- else if and (eq $setting "auto") (or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled) -}}true
{{- end -}}
{{- end -}}

{{/* Render-time checks: configurations that cannot work fail here with a clear message. */}}
{{- define "polyroute.validate" -}}
{{- if and (or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled) (not (include "polyroute.hasRedis" .)) -}}
{{- fail "replicas need shared state: set redis.enabled or redis.url (or redis.existingSecret)" -}}
{{- end -}}
{{- if and .Values.redis.enabled (or .Values.redis.url .Values.redis.existingSecret) -}}
{{- fail "redis: set either redis.enabled (in-chart Redis) or redis.url/redis.existingSecret (existing Redis), not both" -}}
{{- end -}}
{{- if and .Values.qdrant.enabled .Values.qdrant.url -}}
{{- fail "qdrant: set either qdrant.enabled (in-chart Qdrant) or qdrant.url (existing Qdrant), not both" -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) -}}
{{- fail "autoscaling.maxReplicas must be >= autoscaling.minReplicas" -}}
{{- end -}}
{{- if and .Values.podDisruptionBudget.minAvailable .Values.podDisruptionBudget.maxUnavailable -}}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable, not both" -}}
{{- end -}}
{{- if and .Values.retrain.enabled (not (include "polyroute.hasRedis" .)) -}}
{{- fail "retrain: the retrain job reads the ledger from Redis: set redis.enabled or redis.url (or redis.existingSecret)" -}}
{{- end -}}
{{- if and .Values.retrain.enabled (not .Values.routerStore.existingClaim) -}}
{{- fail "retrain: set routerStore.existingClaim (a ReadWriteMany PVC) so the gateway sees the models the job trains" -}}
{{- end -}}
{{- if and .Values.localModel.enabled (not (or .Values.localModel.model.package .Values.localModel.model.existingClaim)) -}}
{{- fail "localModel: set localModel.model.package (a GGUF package in the image) or localModel.model.existingClaim (a PVC holding the file)" -}}
{{- end -}}
{{- end -}}

{{/* The pod-level and container-level security contexts every workload shares. */}}
{{- define "polyroute.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
