{{- define "myserve.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "myserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "myserve.labels" -}}
{{ include "myserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "myserve.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "myserve.fullname" .)) -}}
{{- end -}}

{{- define "myserve.cacheClaim" -}}
{{- .Values.cache.persistentVolumeClaim.existingClaim | default (printf "%s-cache" (include "myserve.fullname" .)) -}}
{{- end -}}

{{- /* nvidia.com/gpu or google.com/tpu; "" on CPU */ -}}
{{- define "myserve.acceleratorResource" -}}
{{- $types := dict "cpu" "" "gpu" "nvidia.com/gpu" "tpu" "google.com/tpu" -}}
{{- if not (hasKey $types .Values.accelerator.type) -}}
{{- fail (printf "accelerator.type must be cpu, gpu or tpu, not %q" .Values.accelerator.type) -}}
{{- end -}}
{{- get $types .Values.accelerator.type -}}
{{- end -}}
