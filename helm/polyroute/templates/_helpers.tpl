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

{{/* The gateway container's own env entries (list items at column 0). Every setting the chart
sets from a value is here, and extraEnv may not repeat one of these names (polyroute.validateExtraEnv). */}}
{{- define "polyroute.gatewayEnv" -}}
- {name: POLYROUTE_HOST, value: "0.0.0.0"}
- {name: POLYROUTE_PORT, value: {{ .Values.containerPort | quote }}}
- {name: POLYROUTE_DATA_DIR, value: {{ .Values.dataDir | quote }}}
- {name: POLYROUTE_LOCAL_WORKERS, value: {{ ternary "true" "false" (and .Values.localWorkers (not .Values.localModel.enabled)) | quote }}}
- {name: POLYROUTE_POLICY_RELOAD_INTERVAL_S, value: {{ .Values.policyReloadIntervalSeconds | quote }}}
- {name: POLYROUTE_GRACEFUL_SHUTDOWN_S, value: {{ .Values.gracefulShutdownSeconds | toString | quote }}}
- {name: POLYROUTE_READY_REQUIRES_STORE, value: {{ ternary "true" "false" .Values.readyRequiresStore | quote }}}
- {name: HOME, value: /tmp}
- {name: HF_HUB_OFFLINE, value: "1"}
- {name: LITELLM_LOCAL_MODEL_COST_MAP, value: "True"}
{{- if .Values.workers }}
- {name: POLYROUTE_WORKERS_FILE, value: {{ printf "%s/workers.yaml" .Values.config.mountPath | quote }}}
{{- end }}
{{- if .Values.policy }}
- {name: POLYROUTE_POLICY_FILE, value: {{ printf "%s/policy.yaml" .Values.config.mountPath | quote }}}
{{- end }}
{{- if .Values.adminKeySecret }}
- name: POLYROUTE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ .Values.adminKeySecret | quote }}, key: {{ .Values.adminKeySecretKey | quote }}}
{{- else if and .Values.createSecret.enabled .Values.createSecret.adminKey }}
- name: POLYROUTE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "polyroute.secretName" . | quote }}, key: admin-key}
{{- end }}
{{- with (include "polyroute.redisEnv" . | trim) }}
{{ . }}
{{- if $.Values.ledgerStreamMax }}
- {name: POLYROUTE_LEDGER_STREAM_MAX, value: {{ $.Values.ledgerStreamMax | int | toString | quote }}}
{{- end }}
{{- end }}
{{- if .Values.routerStore.existingClaim }}
- {name: POLYROUTE_ROUTER_DIR, value: {{ .Values.routerStore.mountPath | quote }}}
{{- end }}
{{- $qdrantUrl := .Values.qdrant.url -}}
{{- if .Values.qdrant.enabled }}
{{- $qdrantUrl = printf "http://%s:%d" (include "polyroute.qdrantName" .) (int .Values.qdrant.httpPort) -}}
{{- end }}
{{- if $qdrantUrl }}
- {name: POLYROUTE_QDRANT_URL, value: {{ $qdrantUrl | quote }}}
- {name: QDRANT_URL, value: {{ $qdrantUrl | quote }}}
{{- end }}
{{- end -}}

{{/* The value that sets each env var the chart renders, for the extraEnv refusal. */}}
{{- define "polyroute.envSources" -}}
POLYROUTE_HOST: "the chart (the gateway listens on all interfaces)"
POLYROUTE_PORT: containerPort
POLYROUTE_DATA_DIR: dataDir
POLYROUTE_LOCAL_WORKERS: "localWorkers (forced off by localModel.enabled)"
POLYROUTE_POLICY_RELOAD_INTERVAL_S: policyReloadIntervalSeconds
POLYROUTE_GRACEFUL_SHUTDOWN_S: gracefulShutdownSeconds
POLYROUTE_READY_REQUIRES_STORE: readyRequiresStore
POLYROUTE_WORKERS_FILE: workers
POLYROUTE_POLICY_FILE: policy
POLYROUTE_ADMIN_KEY: "adminKeySecret (or createSecret.adminKey)"
REDIS_URL: "redis.url, redis.existingSecret or redis.enabled"
POLYROUTE_LEDGER_STREAM_MAX: ledgerStreamMax
POLYROUTE_ROUTER_DIR: routerStore.mountPath
POLYROUTE_QDRANT_URL: "qdrant.url or qdrant.enabled"
QDRANT_URL: "qdrant.url or qdrant.enabled"
{{- end -}}

{{/* extraEnv may add settings, not repeat the chart's own: with two entries of one name the later
wins in the kubelet, so a value the docs describe would silently not be the one in force. */}}
{{- define "polyroute.validateExtraEnv" -}}
{{- $own := dict -}}
{{- range (include "polyroute.gatewayEnv" . | fromYamlArray) -}}
{{- $_ := set $own .name true -}}
{{- end -}}
{{- $sources := include "polyroute.envSources" . | fromYaml -}}
{{- range $i, $entry := .Values.extraEnv -}}
{{- if not (kindIs "map" $entry) -}}
{{- fail (printf "extraEnv[%d]: each entry must be an EnvVar ({name: ..., value: ...} or valueFrom), got %v" $i $entry) -}}
{{- end -}}
{{- if hasKey $own (toString $entry.name) -}}
{{- fail (printf "extraEnv[%d]: %s is set by the chart itself; set the value %s instead" $i $entry.name (get $sources (toString $entry.name) | default "that sets it")) -}}
{{- end -}}
{{- end -}}
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
{{- $qdrantTag := toString .Values.qdrant.image.tag -}}
{{- if and .Values.qdrant.enabled (regexMatch "^v?[0-9]+[.][0-9]+[.][0-9]+$" $qdrantTag) -}}
{{- if not (semverCompare ">=1.14.0" (trimPrefix "v" $qdrantTag)) -}}
{{- fail (printf "qdrant.image.tag %s is older than v1.14.0, the first Qdrant server that runs the formula queries the gateway's hybrid search sends (retrieval/engine.py): collections would fail on every search" $qdrantTag) -}}
{{- end -}}
{{- end -}}
{{- if not (kindIs "bool" .Values.readyRequiresStore) -}}
{{- fail (printf "readyRequiresStore must be true or false, got %v" .Values.readyRequiresStore) -}}
{{- end -}}
{{- $flushSeconds := 5 -}}
{{- if lt (int .Values.gracefulShutdownSeconds) 0 -}}
{{- fail (printf "gracefulShutdownSeconds must be 0 or more, got %v" .Values.gracefulShutdownSeconds) -}}
{{- end -}}
{{- if gt (add (int .Values.preStopSleepSeconds) (int .Values.gracefulShutdownSeconds) $flushSeconds) (int .Values.terminationGracePeriodSeconds) -}}
{{- fail (printf "shutdown does not fit the grace period: preStopSleepSeconds (%d) + gracefulShutdownSeconds (%d) + %d s to flush budgets and the ledger exceed terminationGracePeriodSeconds (%d), after which Kubernetes kills the gateway before it has written its books; raise terminationGracePeriodSeconds or lower the others" (int .Values.preStopSleepSeconds) (int .Values.gracefulShutdownSeconds) $flushSeconds (int .Values.terminationGracePeriodSeconds)) -}}
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
