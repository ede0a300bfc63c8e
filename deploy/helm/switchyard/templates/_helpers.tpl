{{/* Names and labels. */}}
{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "switchyard.fullname" -}}
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

{{- define "switchyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "switchyard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "switchyard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "switchyard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret the pods read environment variables from; empty for none. */}}
{{- define "switchyard.secretName" -}}
{{- if .Values.secret.existingSecret }}
{{- .Values.secret.existingSecret }}
{{- else if and .Values.secret.create .Values.secret.env }}
{{- include "switchyard.fullname" . }}
{{- end }}
{{- end }}

{{/*
The gateway configuration as JSON: `.Values.config` with the listeners the
chart owns, and each Kubernetes discovery section's namespace defaulted to the
release's. Consumers turn it back into a dict with fromJson.
*/}}
{{- define "switchyard.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $server := default dict $cfg.server }}
{{- $_ := set $server "listen" "0.0.0.0:8080" }}
{{- $_ := set $cfg "server" $server }}
{{- if .Values.admin.enabled }}
{{- $_ := set $cfg "admin" (dict "listen" (printf "0.0.0.0:%v" .Values.admin.port) "token_env" "SWITCHYARD_ADMIN_TOKEN") }}
{{- end }}
{{- range $pool := (default list $cfg.pools) }}
{{- if $pool.kubernetes }}
{{- if not $pool.kubernetes.namespace }}
{{- $_ := set $pool.kubernetes "namespace" $.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* Namespaces whose pods some pool watches. */}}
{{- define "switchyard.watchedNamespaces" -}}
{{- $cfg := include "switchyard.config" . | fromJson }}
{{- $ns := list }}
{{- range $pool := (default list $cfg.pools) }}
{{- if $pool.kubernetes }}
{{- $ns = append $ns $pool.kubernetes.namespace }}
{{- end }}
{{- end }}
{{- toJson (uniq $ns) }}
{{- end }}

{{/*
Namespaces where a pool follows an InferencePool (its watcher reads them too).
*/}}
{{- define "switchyard.inferencePoolNamespaces" -}}
{{- $cfg := include "switchyard.config" . | fromJson }}
{{- $ns := list }}
{{- range $pool := (default list $cfg.pools) }}
{{- if and $pool.kubernetes $pool.kubernetes.inference_pool }}
{{- $ns = append $ns $pool.kubernetes.namespace }}
{{- end }}
{{- end }}
{{- toJson (uniq $ns) }}
{{- end }}

{{/*
terminationGracePeriodSeconds: the gateway's unready grace plus drain deadline
(its defaults when unset: 0 and 30000 ms), rounded up, plus the margin.
*/}}
{{- define "switchyard.terminationGrace" -}}
{{- $server := default dict .Values.config.server }}
{{- $ms := add (int64 (default 0 $server.unready_grace_ms)) (int64 (default 30000 $server.drain_timeout_ms)) }}
{{- add (div (add $ms 999) 1000) (int64 .Values.terminationGraceMarginSeconds) }}
{{- end }}

{{/*
TOML from a dict. Helm's toToml writes every number as a float (8000.0), which
the gateway's integer keys reject, so this emitter writes numbers as JSON does
(8000, 0.5). Tables become [section] / [[section]] headers at the top level and
inline tables below it.
*/}}
{{- define "switchyard.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{- define "switchyard.toml.value" -}}
{{- $k := kindOf . }}
{{- if eq $k "map" }}
{{- $parts := list }}
{{- range $key, $v := . }}
{{- $parts = append $parts (printf "%s = %s" (include "switchyard.toml.key" $key) (include "switchyard.toml.value" $v)) }}
{{- end }}
{{- printf "{ %s }" (join ", " $parts) }}
{{- else if eq $k "slice" }}
{{- $parts := list }}
{{- range $v := . }}
{{- $parts = append $parts (include "switchyard.toml.value" $v) }}
{{- end }}
{{- printf "[%s]" (join ", " $parts) }}
{{- else }}
{{- toJson . }}
{{- end }}
{{- end }}

{{/* Scalars and lists of scalars of one table, as `key = value` lines. */}}
{{- define "switchyard.toml.table" -}}
{{- range $key, $v := . }}
{{- if not (or (eq (kindOf $v) "map") (and (eq (kindOf $v) "slice") $v (eq (kindOf (first $v)) "map"))) }}
{{ include "switchyard.toml.key" $key }} = {{ include "switchyard.toml.value" $v }}
{{- end }}
{{- end }}
{{- end }}

{{/* Sub-tables of a table at `path`, as [path.key] / [[path.key]] sections. */}}
{{- define "switchyard.toml.sections" -}}
{{- $path := .path }}
{{- range $key, $v := .table }}
{{- $name := printf "%s%s" (ternary "" (printf "%s." $path) (eq $path "")) (include "switchyard.toml.key" $key) }}
{{- if eq (kindOf $v) "map" }}

[{{ $name }}]
{{- include "switchyard.toml.table" $v }}
{{- include "switchyard.toml.sections" (dict "path" $name "table" $v) }}
{{- else if and (eq (kindOf $v) "slice") $v (eq (kindOf (first $v)) "map") }}
{{- range $item := $v }}

[[{{ $name }}]]
{{- include "switchyard.toml.table" $item }}
{{- include "switchyard.toml.sections" (dict "path" $name "table" $item) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "switchyard.toml" -}}
{{- include "switchyard.toml.table" . }}
{{- include "switchyard.toml.sections" (dict "path" "" "table" .) }}
{{- end }}
