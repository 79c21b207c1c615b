{{/* Names: <release>-kvroute unless the release name already contains the chart name. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.redisName" -}}
{{- printf "%s-redis" (include "kvroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.commonLabels" -}}
helm.sh/chart: {{ include "kvroute.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvroute.labels" -}}
{{ include "kvroute.commonLabels" . }}
{{ include "kvroute.selectorLabels" . }}
{{- end }}

{{- define "kvroute.redisLabels" -}}
{{ include "kvroute.commonLabels" . }}
{{ include "kvroute.redisSelectorLabels" . }}
{{- end }}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "kvroute.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.discovery.kubernetes.enabled }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
A probe of the router's port (.probe: the values' probe) as TLS requires: over https with
tls.existingSecret, and a TCP check with tls.clientCA (kubelet presents no client certificate).
*/}}
{{- define "kvroute.probe" -}}
{{- $probe := deepCopy .probe }}
{{- if and .root.Values.tls.existingSecret $probe.httpGet }}
{{- if .root.Values.tls.clientCA }}
{{- $_ := set $probe "tcpSocket" (dict "port" $probe.httpGet.port) }}
{{- $_ := unset $probe "httpGet" }}
{{- else }}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{- define "kvroute.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Refuse values that cannot work: several router replicas (or an autoscaler that may make them)
with the memory index, where each replica would learn the engines' caches on its own and send
the same prefix to different engines.
*/}}
{{- define "kvroute.validate" -}}
{{- $several := or .Values.autoscaling.enabled (gt (int .Values.replicaCount) 1) }}
{{- $shared := or .Values.redis.enabled (eq (((.Values.config).index).store | default "memory") "redis") }}
{{- if and $several (not $shared) }}
{{- $asked := ternary "autoscaling.enabled=true" (printf "replicaCount=%d" (int .Values.replicaCount)) .Values.autoscaling.enabled }}
{{- fail (printf "%s needs a shared prefix index: with the memory index each router replica would learn the engines' caches on its own and send the same prefix to different engines. Set redis.enabled=true (the chart's Valkey; or redis.mode=external with redis.external.url), or run one replica (replicaCount=1, autoscaling.enabled=false)." $asked) }}
{{- end }}
{{- end }}

{{/*
The router's configuration file, built from .Values.config (the same keys as
config.example.yaml). The chart owns `listen` (the container port, the SIGTERM drain, TLS),
`admin.listen` (loopback unless admin.expose) and, with admin.existingSecret, `admin.key_env`,
`discovery` when discovery.kubernetes is enabled (`backends` is dropped then), and with
redis.enabled the index store and its connection; everything else is the user's.
*/}}
{{- define "kvroute.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $listen := dict "host" "0.0.0.0" "port" (int .Values.service.targetPort) "drain_timeout_s" (int .Values.termination.shutdownSeconds) }}
{{- with .Values.tls.existingSecret }}
{{- $tls := dict "cert" "/etc/kvroute/tls/tls.crt" "key" "/etc/kvroute/tls/tls.key" }}
{{- if $.Values.tls.clientCA }}
{{- $_ := set $tls "client_ca" "/etc/kvroute/tls/ca.crt" }}
{{- end }}
{{- $_ := set $listen "tls" $tls }}
{{- end }}
{{- $_ := set $config "listen" $listen }}
{{- $admin := deepCopy ($config.admin | default dict) }}
{{- $_ := set $admin "listen" (dict "host" (ternary "0.0.0.0" "127.0.0.1" .Values.admin.expose) "port" (int .Values.admin.port)) }}
{{- if .Values.admin.existingSecret }}
{{- $_ := set $admin "key_env" "KVROUTE_ADMIN_KEY" }}
{{- else if and .Values.admin.expose (not (or $admin.key $admin.key_env $admin.key_file)) }}
{{- fail "admin.expose needs an admin key: set admin.existingSecret (or config.admin.key_env with env)" }}
{{- end }}
{{- $_ := set $config "admin" $admin }}
{{- with .Values.service.metricsPort }}
{{- $_ := set $config "metrics" (dict "listen" (dict "host" "0.0.0.0" "port" (int .))) }}
{{- end }}
{{- if .Values.discovery.kubernetes.enabled }}
{{- $_ := unset $config "backends" }}
{{- $_ := set $config "discovery" (dict "kind" "kubernetes" "kubernetes" (deepCopy .Values.discovery.kubernetes.settings)) }}
{{- with .Values.discovery.kubernetes.roles }}
{{- $_ := set $config.discovery "roles" (deepCopy .) }}
{{- end }}
{{- end }}
{{- if .Values.redis.enabled }}
{{- $index := $config.index | default dict }}
{{- $redis := $index.redis | default dict }}
{{- $_ := set $redis "url" (include "kvroute.redisUrl" .) }}
{{- if eq (include "kvroute.redisPasswordSecret" .) "true" }}
{{- $_ := set $redis "password_env" "KVROUTE_REDIS_PASSWORD" }}
{{- end }}
{{- $_ := set $index "redis" $redis }}
{{- $_ := set $index "store" "redis" }}
{{- $_ := set $config "index" $index }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{- define "kvroute.discoveryNamespace" -}}
{{- .Values.discovery.kubernetes.settings.namespace | default .Release.Namespace }}
{{- end }}

{{- define "kvroute.redisUrl" -}}
{{- if eq .Values.redis.mode "builtin" }}
{{- printf "redis://%s.%s.svc:6379/0" (include "kvroute.redisName" .) .Release.Namespace }}
{{- else }}
{{- required "redis.external.url is required when redis.mode is external" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* "true" when the router reads the Redis password from an existing Secret. */}}
{{- define "kvroute.redisPasswordSecret" -}}
{{- and .Values.redis.enabled (eq .Values.redis.mode "external") (ne .Values.redis.external.existingSecret "") }}
{{- end }}
