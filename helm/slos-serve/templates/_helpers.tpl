{{/* Names follow the usual Helm conventions: <release>-<chart>, capped at 63 characters. */}}
{{- define "slos-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fullname is capped at 47 characters, the longest RayService name KubeRay takes
(MaxRayServiceNameLength: it names the RayCluster after it with 6 more, and that cluster's
Services with up to 10 more, in 63); the suffixed names here (-http, -grpc, -metrics,
-door-metrics, -workers) fit too.
*/}}
{{- define "slos-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
What values.schema.json cannot say, as it compares no two values: each fails the install
naming the values, rather than a Ray cluster starting with a config the app refuses or
KubeRay rejects. The defaults are the app's (cluster.autoscale.AutoscaleConfig: min_replicas
and max_replicas 1; cluster.config.ClusterConfig: replicas 2).
*/}}
{{- define "slos-serve.validate" -}}
{{- $cluster := .Values.cluster }}
{{- if kindIs "map" $cluster.autoscale }}
{{- $min := int (default 1 $cluster.autoscale.min_replicas) }}
{{- $max := int (default 1 $cluster.autoscale.max_replicas) }}
{{- $replicas := int (default 2 $cluster.replicas) }}
{{- if gt $min $max }}
{{- fail (printf "cluster.autoscale.min_replicas (%d) must be <= max_replicas (%d)" $min $max) }}
{{- end }}
{{- if or (lt $replicas $min) (gt $replicas $max) }}
{{- fail (printf "cluster.replicas (%d) must be within cluster.autoscale's [min_replicas, max_replicas] = [%d, %d]" $replicas $min $max) }}
{{- end }}
{{- end }}
{{- $tiers := list }}
{{- range $cluster.tiers }}
{{- $tiers = append $tiers .name }}
{{- end }}
{{- if ne (len $tiers) (len (uniq $tiers)) }}
{{- fail (printf "cluster.tiers: names must be unique, got %s" (join ", " $tiers)) }}
{{- end }}
{{- $ports := .Values.ports }}
{{- $numbers := list (int $ports.http) (int $ports.grpc) (int $ports.dashboard) (int $ports.metrics) 6379 10001 }}
{{- if ne (len $numbers) (len (uniq $numbers)) }}
{{- fail (printf "ports: http (%d), grpc (%d), dashboard (%d) and metrics (%d) must differ from each other and from Ray's GCS and client ports (6379, 10001)" (int $ports.http) (int $ports.grpc) (int $ports.dashboard) (int $ports.metrics)) }}
{{- end }}
{{- $groups := list }}
{{- range .Values.workerGroups }}
{{- $groups = append $groups .name }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "workerGroups[%s]: minReplicas (%d) must be <= maxReplicas (%d)" .name (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- if or (lt (int .replicas) (int .minReplicas)) (gt (int .replicas) (int .maxReplicas)) }}
{{- fail (printf "workerGroups[%s]: replicas (%d) must be within [minReplicas, maxReplicas] = [%d, %d]" .name (int .replicas) (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- end }}
{{- if ne (len $groups) (len (uniq $groups)) }}
{{- fail (printf "workerGroups: names must be unique, got %s" (join ", " $groups)) }}
{{- end }}
{{- if and (kindIs "string" .Values.defaultSlo) (not (has .Values.defaultSlo $tiers)) }}
{{- fail (printf "defaultSlo: %s is not a tier of cluster.tiers (%s)" .Values.defaultSlo (join ", " $tiers)) }}
{{- end }}
{{- end }}

{{- define "slos-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slos-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "slos-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "slos-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "slos-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Where the API keys file is inside the containers; null when authentication is off. */}}
{{- define "slos-serve.apiKeysFile" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- printf "%s/%s" .Values.apiKeys.mountPath .Values.apiKeys.key }}
{{- end }}
{{- end }}

{{/* The front door's grpc args: its port on 0.0.0.0, and the TLS Secret's files when set. */}}
{{- define "slos-serve.grpcArgs" -}}
{{- $grpc := dict "host" "0.0.0.0" "port" .Values.ports.grpc }}
{{- if .Values.grpcTls.existingSecret }}
{{- $_ := set $grpc "tls_cert_file" (printf "%s/tls.crt" .Values.grpcTls.mountPath) }}
{{- $_ := set $grpc "tls_key_file" (printf "%s/tls.key" .Values.grpcTls.mountPath) }}
{{- end }}
{{- toYaml $grpc }}
{{- end }}

{{/* Ray Serve's http_options: on 0.0.0.0, so the Services reach the proxies. */}}
{{- define "slos-serve.httpOptions" -}}
{{- $options := dict "host" "0.0.0.0" "port" .Values.ports.http }}
{{- with .Values.httpRequestTimeoutS }}
{{- $_ := set $options "request_timeout_s" . }}
{{- end }}
{{- toYaml $options }}
{{- end }}

{{/*
The Serve config (serveConfigV2): the same document as deploy/serve-*.yaml, except that HTTP
and gRPC listen on 0.0.0.0 so the Services can reach them. The front door's defaults are
written only when set: unset, the app's own apply.
*/}}
{{- define "slos-serve.serveConfig" -}}
{{- $keysFile := include "slos-serve.apiKeysFile" . }}
{{- $args := dict
  "cluster" .Values.cluster
  "http" (dict "host" "0.0.0.0" "port" .Values.ports.http)
  "grpc" (include "slos-serve.grpcArgs" . | fromYaml)
  "api_keys_file" (ternary $keysFile nil (ne $keysFile ""))
  "tool_call_parser" .Values.toolCallParser
  "reasoning_parser" .Values.reasoningParser
  "max_request_mb" .Values.maxRequestMb
}}
{{- with .Values.defaultSlo }}
{{- $_ := set $args "default_slo" . }}
{{- end }}
{{- with .Values.defaultChatMaxTokens }}
{{- $_ := set $args "default_chat_max_tokens" . }}
{{- end }}
{{- $app := dict
  "name" "slos-serve"
  "route_prefix" "/"
  "import_path" "router.app:build_app"
  "args" $args
}}
{{- $config := dict
  "proxy_location" "EveryNode"
  "http_options" (include "slos-serve.httpOptions" . | fromYaml)
  "grpc_options" (dict "port" .Values.ports.grpc)
  "applications" (list $app)
}}
{{- toYaml $config }}
{{- end }}

{{/*
One Ray pod template. Called with a dict: root (the chart context), group (head or a worker
group from values), component ("head" or "worker") and ports (name -> containerPort).
Ray Serve keeps the http_options it started with (a running Serve logs and ignores new ones),
so the head's template carries them too: a change makes KubeRay start a new RayCluster, whose
Serve starts with them.
*/}}
{{- define "slos-serve.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $gpus := int (default 0 $group.gpus) }}
{{- $annotations := deepCopy (default dict $root.Values.podAnnotations) }}
{{- if eq .component "head" }}
{{- $_ := set $annotations "slos-serve/http-options" (include "slos-serve.httpOptions" $root | fromYaml | toJson) }}
{{- end -}}
metadata:
  labels:
    {{- include "slos-serve.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-{{ .component }}
      image: {{ include "slos-serve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- range $name, $port := .ports }}
        - name: {{ $name }}
          containerPort: {{ $port }}
          protocol: TCP
        {{- end }}
      {{- if or $root.Values.models.volume $root.Values.extraEnv }}
      env:
        {{- if $root.Values.models.volume }}
        - name: HF_HOME
          value: {{ printf "%s/huggingface" $root.Values.models.mountPath }}
        {{- end }}
        {{- with $root.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      resources:
        {{- $resources := deepCopy (default dict $group.resources) }}
        {{- if gt $gpus 0 }}
        {{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.requests)) }}
        {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.limits)) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        {{- if $root.Values.models.volume }}
        - name: models
          mountPath: {{ $root.Values.models.mountPath }}
        {{- end }}
        {{- if $root.Values.apiKeys.existingSecret }}
        - name: api-keys
          mountPath: {{ $root.Values.apiKeys.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $root.Values.grpcTls.existingSecret }}
        - name: grpc-tls
          mountPath: {{ $root.Values.grpcTls.mountPath }}
          readOnly: true
        {{- end }}
  volumes:
    # Ray's object store lives in shared memory; the container default (64 MiB) is too small.
    - name: shm
      emptyDir:
        medium: Memory
    {{- with $root.Values.models.volume }}
    - name: models
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if $root.Values.apiKeys.existingSecret }}
    - name: api-keys
      secret:
        secretName: {{ $root.Values.apiKeys.existingSecret }}
        items:
          - key: {{ $root.Values.apiKeys.key }}
            path: {{ $root.Values.apiKeys.key }}
    {{- end }}
    {{- if $root.Values.grpcTls.existingSecret }}
    - name: grpc-tls
      secret:
        secretName: {{ $root.Values.grpcTls.existingSecret }}
        items:
          - key: tls.crt
            path: tls.crt
          - key: tls.key
            path: tls.key
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
