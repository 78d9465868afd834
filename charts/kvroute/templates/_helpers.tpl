{{/* The release's resource name prefix. */}}
{{- define "kvroute.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.operator" -}}
{{- printf "%s-operator" (include "kvroute.fullname" .) -}}
{{- end -}}

{{/* A pool's router name: <fullname>-<pool>. */}}
{{- define "kvroute.router" -}}
{{- printf "%s-%s" (include "kvroute.fullname" .root) .pool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A pool's router picker settings: router.picker with the pool's over it. */}}
{{- define "kvroute.picker" -}}
{{- toJson (mergeOverwrite (deepCopy .root.Values.router.picker) (deepCopy (default dict .pool.picker))) -}}
{{- end -}}

{{/* "true" when a pool's routers serve the OpenAI API (not picker-only). */}}
{{- define "kvroute.servesApi" -}}
{{- $picker := fromJson (include "kvroute.picker" .) -}}
{{- if or (not $picker.enabled) $picker.api }}true{{ end -}}
{{- end -}}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvroute.labels" -}}
app.kubernetes.io/part-of: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Pod-level hardening shared by every pod. */}}
{{- define "kvroute.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level hardening shared by every container. */}}
{{- define "kvroute.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The namespace a pool lives in. */}}
{{- define "kvroute.poolNamespace" -}}
{{- default .root.Release.Namespace .pool.namespace -}}
{{- end -}}
