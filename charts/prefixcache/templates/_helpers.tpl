{{/* Names and labels match what the operator renders for a PrefixCacheDeployment named like the release. */}}
{{- define "prefixcache.selectorLabels" -}}
app.kubernetes.io/name: prefixcache
app.kubernetes.io/instance: {{ .root.Release.Name | quote }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Pod templates leave out the chart's version: a chart upgrade that changes nothing else must not
roll every (GPU) pod. */}}
{{- define "prefixcache.podLabels" -}}
{{ include "prefixcache.selectorLabels" . }}
app.kubernetes.io/part-of: prefixcache
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "prefixcache.labels" -}}
{{ include "prefixcache.podLabels" . }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
{{- end }}

{{- define "prefixcache.modelDir" -}}
{{- if eq .Values.model.source "Embedded" -}}
/opt/prefixcache/models/SmolLM2-135M-Instruct
{{- else -}}
{{ trimSuffix "/" (printf "/models/%s" (trimSuffix "/" .Values.model.path)) }}
{{- end }}
{{- end }}

{{- define "prefixcache.configData" -}}
{{- if .Values.otel.endpoint }}
OTEL_TRACES_EXPORTER: otlp
OTEL_EXPORTER_OTLP_ENDPOINT: {{ .Values.otel.endpoint | quote }}
OTEL_EXPORTER_OTLP_PROTOCOL: grpc
{{- else }}
OTEL_TRACES_EXPORTER: none
OTEL_METRICS_EXPORTER: none
OTEL_LOGS_EXPORTER: none
{{- end }}
{{- end }}

{{/* Pod template annotation: a change of the shared environment rolls the pods. */}}
{{- define "prefixcache.configHash" -}}
{{ include "prefixcache.configData" . | fromYaml | toJson | sha256sum }}
{{- end }}

{{/* kvCacheMemory in bytes: an integer as is, a quantity ("8Gi", "1.5G") times its suffix; a quantity
     that is not a whole number of bytes is refused, as the operator refuses it. */}}
{{- define "prefixcache.kvCacheMemoryBytes" -}}
{{- $quantity := .Values.kvCacheMemory }}
{{- if kindIs "string" $quantity }}
{{- $suffix := regexFind "(Ki|Mi|Gi|Ti|k|M|G|T)$" $quantity }}
{{- $number := trimSuffix $suffix $quantity }}
{{- $scale := get (dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776) $suffix }}
{{- if contains "." $number }}
{{- $bytes := mulf (float64 $number) $scale }}
{{- if ne $bytes (float64 (int64 $bytes)) }}
{{- fail (printf "kvCacheMemory: %q must be a positive whole number of bytes" $quantity) }}
{{- end }}
{{- int64 $bytes }}
{{- else }}
{{- mul (int64 $number) $scale }}
{{- end }}
{{- else }}
{{- int64 $quantity }}
{{- end }}
{{- end }}

{{/* Engine pod template annotation: what the cached blocks mean and where they live (the operator's
     rollout_hashes.cache_identity, the same keys and JSON). Tracing is not in it: it never restarts GPU pods. */}}
{{- define "prefixcache.cacheIdentity" -}}
{{- $identity := dict "modelDir" (include "prefixcache.modelDir" .) "claimName" (ternary .Values.model.claimName "" (eq .Values.model.source "PersistentVolumeClaim")) "workerImage" .Values.worker.image "blockSize" (int64 .Values.blockSize) "hashAlgorithm" .Values.hashAlgorithm "enablePrefixCaching" .Values.enablePrefixCaching "dtype" .Values.worker.dtype "attentionBackend" .Values.worker.attentionBackend "gpus" (int64 .Values.worker.gpus) "kvCacheMemoryBytes" (int64 (include "prefixcache.kvCacheMemoryBytes" .)) }}
{{- toJson $identity | sha256sum }}
{{- end }}

{{/* One service container. Arguments: root, name, image, args (list), port (none for a service on
     loopback only), startupSeconds, resources (dict); optional healthPort (the plaintext health port the
     probes then check) and healthPortName (default health; port names are unique within a pod),
     extraEnv, extraMounts, extraPorts (lists), restartPolicy (a native sidecar) and readyService (the
     gRPC health service readiness checks, instead of the process's). */}}
{{- define "prefixcache.container" -}}
- name: {{ .name }}
  image: {{ .image | quote }}
  imagePullPolicy: {{ .root.Values.imagePullPolicy | quote }}
  args: {{ toJson .args }}
  {{- with .restartPolicy }}
  restartPolicy: {{ . }}
  {{- end }}
  ports:
    {{- with .port }}
    - {name: grpc, containerPort: {{ . }}, protocol: TCP}
    {{- end }}
    {{- with .healthPort }}
    - {name: {{ $.healthPortName | default "health" }}, containerPort: {{ . }}, protocol: TCP}
    {{- end }}
    {{- with .extraPorts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  envFrom:
    - configMapRef: {name: {{ .root.Release.Name }}-env}
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - {name: OTEL_SERVICE_NAME, value: prefixcache-{{ .name }}}
    - {name: OTEL_RESOURCE_ATTRIBUTES, value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"}
    {{- with .extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $probed := .healthPort | default .port }}
  startupProbe: {grpc: {port: {{ $probed }}}, periodSeconds: 5, failureThreshold: {{ div .startupSeconds 5 }}}
  readinessProbe: {grpc: {port: {{ $probed }}{{ with .readyService }}, service: {{ . }}{{ end }}}, periodSeconds: 5, failureThreshold: 2}
  livenessProbe: {grpc: {port: {{ $probed }}}, periodSeconds: 10, failureThreshold: 3, timeoutSeconds: 5}
  securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    {{- with .extraMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{- define "prefixcache.podSecurity" -}}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* requests/limits without empty maps, as the operator renders them. */}}
{{- define "prefixcache.resources" -}}
{{- $out := dict }}
{{- with .requests }}{{ $_ := set $out "requests" . }}{{ end }}
{{- with .limits }}{{ $_ := set $out "limits" . }}{{ end }}
{{- toJson $out }}
{{- end }}

{{- define "prefixcache.modelMounts" -}}
{{- if eq .Values.model.source "PersistentVolumeClaim" -}}
[{"name": "model", "mountPath": "/models", "readOnly": true}]
{{- else -}}
[]
{{- end }}
{{- end }}

{{/* Where a component's pods may run, and how they pull the image. Arguments: root, placement (the
     component's values: nodeSelector, tolerations). */}}
{{- define "prefixcache.placement" -}}
{{- with .placement.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* What the operator does inside the namespaces it watches. */}}
{{- define "prefixcache.operatorNamespacedRules" -}}
- apiGroups: [prefixcache.dev]
  resources: [prefixcachedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [prefixcache.dev]
  resources: [prefixcachedeployments/status]
  verbs: [get, patch]
# Children carry blockOwnerDeletion; where OwnerReferencesPermissionEnforcement is on (OpenShift),
# setting it needs update on the owner's finalizers.
- apiGroups: [prefixcache.dev]
  resources: [prefixcachedeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch]  # watched: a deleted or changed child is put back
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]  # the cache-health poller finds the ready engine pods and reads each one's cache statistics
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
