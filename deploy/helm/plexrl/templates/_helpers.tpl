{{/* Names, labels and the pieces every PlexRL container shares. */}}

{{- define "plexrl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: (dict "root" $ "component" "gateway") */}}
{{- define "plexrl.name" -}}
{{- printf "%s-%s" (include "plexrl.fullname" .root) .component -}}
{{- end -}}

{{- define "plexrl.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "plexrl.labels" -}}
{{ include "plexrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "plexrl.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "plexrl.secretName" -}}
{{- default (printf "%s-secrets" (include "plexrl.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "plexrl.stateStoreUrl" -}}
{{- if .Values.stateStore.enabled -}}
{{- printf "http://%s:%v" (include "plexrl.name" (dict "root" . "component" "state-store")) .Values.stateStore.port -}}
{{- else -}}
{{- required "stateStore.url is required when stateStore.enabled is false" .Values.stateStore.url -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations: Prometheus scraping of /metrics on the service's port.
     (dict "root" $ "port" 8000 "extra" .Values.gateway.podAnnotations) */}}
{{- define "plexrl.podAnnotations" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* What every service reads: where the infrastructure is, the cluster's name and
     token, traces. (dict "root" $ "component" "gateway") */}}
{{- define "plexrl.commonEnv" -}}
{{- $root := .root -}}
- name: PLEXRL_KAFKA_BOOTSTRAP
  value: {{ required "kafka.bootstrap is required: the bootstrap servers of an external Kafka" $root.Values.kafka.bootstrap | quote }}
- name: PLEXRL_KAFKA_REPLICATION_FACTOR
  value: {{ $root.Values.kafka.replicationFactor | int | toString | quote }}
- name: PLEXRL_KAFKA_MIN_INSYNC_REPLICAS
  value: {{ $root.Values.kafka.minInsyncReplicas | int | toString | quote }}
{{- $kafka := $root.Values.kafka }}
{{- if ne $kafka.securityProtocol "PLAINTEXT" }}
- name: PLEXRL_KAFKA_SECURITY_PROTOCOL
  value: {{ $kafka.securityProtocol | quote }}
{{- end }}
{{- if $kafka.tls.existingSecret }}
- name: PLEXRL_KAFKA_SSL_CAFILE
  value: /etc/plexrl/kafka-tls/ca.pem
{{- if $kafka.tls.clientCertificate }}
- name: PLEXRL_KAFKA_SSL_CERTFILE
  value: /etc/plexrl/kafka-tls/client.pem
- name: PLEXRL_KAFKA_SSL_KEYFILE
  value: /etc/plexrl/kafka-tls/client.key
{{- end }}
{{- end }}
{{- if hasPrefix "SASL_" $kafka.securityProtocol }}
- name: PLEXRL_KAFKA_SASL_MECHANISM
  value: {{ $kafka.sasl.mechanism | quote }}
- name: PLEXRL_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.existingSecret is required with a SASL_ protocol: a Secret with username and password" $kafka.sasl.existingSecret }}
      key: username
- name: PLEXRL_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $kafka.sasl.existingSecret }}
      key: password
{{- end }}
- name: PLEXRL_REDIS_URL
{{- if $root.Values.redis.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.redis.existingSecret }}
      key: {{ $root.Values.redis.existingSecretKey }}
{{- else }}
  value: {{ required "redis.url is required: the URL of an external Redis" $root.Values.redis.url | quote }}
{{- end }}
{{- with $root.Values.redis.sentinels }}
- name: PLEXRL_REDIS_SENTINELS
  value: {{ . | quote }}
- name: PLEXRL_REDIS_SENTINEL_MASTER
  value: {{ $root.Values.redis.sentinelMaster | quote }}
{{- end }}
- name: PLEXRL_REDIS_WAIT_REPLICAS
  value: {{ $root.Values.redis.waitReplicas | int | toString | quote }}
- name: PLEXRL_STATE_STORE_URL
  value: {{ include "plexrl.stateStoreUrl" $root | quote }}
- name: PLEXRL_CLUSTER_ID
  value: {{ $root.Values.clusterId | quote }}
- name: PLEXRL_LOG_LEVEL
  value: {{ $root.Values.logLevel | quote }}
- name: PLEXRL_SERVICE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "plexrl.secretName" $root }}
      key: service-token
- name: OTEL_SERVICE_NAME
  value: plexrl-{{ .component }}
{{- with $root.Values.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: PLEXRL_TRACE_RATIO
  value: {{ $root.Values.traceRatio | quote }}
{{- end }}
{{- end -}}

{{/* A service's `settings:` map as PLEXRL_<FIELD> variables, then its extraEnv.
     (dict "settings" .Values.gateway.settings "extraEnv" .Values.gateway.extraEnv) */}}
{{- define "plexrl.settingsEnv" -}}
{{- range $field, $value := .settings }}
- name: {{ printf "PLEXRL_%s" ($field | upper) }}
{{- /* YAML numbers arrive as floats: a whole one is written as an integer, not 1e+10. */}}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
  value: {{ $value | int64 | toString | quote }}
{{- else }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* GET /healthz on the container's named port `http`. */}}
{{- define "plexrl.probes" -}}
{{- $get := dict "httpGet" (dict "path" "/healthz" "port" "http") -}}
startupProbe:
  {{- toYaml (merge (deepCopy $get) .Values.probes.startup) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (deepCopy $get) .Values.probes.readiness) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (deepCopy $get) .Values.probes.liveness) | nindent 2 }}
{{- end -}}

{{/* The model registry at /models: the existing claim, or an emptyDir the tiny model is
     built into. */}}
{{- define "plexrl.modelsVolume" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The Kafka TLS Secret's mount and volume (nothing without kafka.tls.existingSecret). */}}
{{- define "plexrl.kafkaTlsMount" -}}
{{- if .Values.kafka.tls.existingSecret }}
- name: kafka-tls
  mountPath: /etc/plexrl/kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "plexrl.kafkaTlsVolume" -}}
{{- with .Values.kafka.tls.existingSecret }}
- name: kafka-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}

{{- define "plexrl.modelsEnv" -}}
- name: PLEXRL_MODEL_REGISTRY
  value: /models
- name: HF_HOME
  value: /models/.hf
{{- end -}}

{{- define "plexrl.modelsMount" -}}
- name: models
  mountPath: /models
  readOnly: {{ not (empty .Values.models.existingClaim) }}
{{- end -}}

{{/* Builds the tiny seeded model when no claim holds the models (models.initTiny). */}}
{{- define "plexrl.modelsInit" -}}
{{- if and (not .Values.models.existingClaim) .Values.models.initTiny }}
initContainers:
  - name: model-init
    image: {{ include "plexrl.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["plexrl", "model", "init-tiny", "/models/tiny-qwen"]
    env:
      {{- include "plexrl.modelsEnv" . | nindent 6 }}
    volumeMounts:
      {{- include "plexrl.modelsMount" . | nindent 6 }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
{{- end }}
{{- end -}}

{{/* The pod-level fields every component shares. (dict "root" $ "values" .Values.gateway) */}}
{{- define "plexrl.podCommon" -}}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget. (dict "root" $ "component" "gateway" "pdb" .Values.gateway.pdb) */}}
{{- define "plexrl.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "plexrl.name" . }}
  labels:
    {{- include "plexrl.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "plexrl.selectorLabels" . | nindent 6 }}
{{- end -}}
