{{/*
Names, labels and the pieces several templates share. The sidecar container is defined here once:
the ConfigMap renders it, and the chart tests hold it equal to the operator's own default
(tracehound.controller.orchestrators.kubeobjects.default_sidecar) for the default values.
*/}}

{{- define "tracehound.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* `<release>-<chart>`, or the release name alone when it already holds the chart's name. */}}
{{- define "tracehound.fullname" -}}
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

{{- define "tracehound.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "tracehound.labels" -}}
helm.sh/chart: {{ include "tracehound.chart" .ctx }}
{{ include "tracehound.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tracehound
{{- end }}

{{- define "tracehound.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tracehound.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The image reference every Tracehound container runs (also given to the operator, which
uses it for the recorder init container of rank pods). */}}
{{- define "tracehound.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "tracehound.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "tracehound.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret (and its key) holding the ClickHouse URL. */}}
{{- define "tracehound.storeSecretName" -}}
{{- if .Values.clickhouse.existingSecret }}
{{- .Values.clickhouse.existingSecret }}
{{- else }}
{{- $_ := required "clickhouse.url: required unless clickhouse.existingSecret names a Secret holding the URL" .Values.clickhouse.url }}
{{- printf "%s-clickhouse" (include "tracehound.fullname" .) }}
{{- end }}
{{- end }}

{{- define "tracehound.storeSecretKey" -}}
{{- if .Values.clickhouse.existingSecret }}{{ .Values.clickhouse.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* The store URL as an environment variable named `name`, from the Secret. */}}
{{- define "tracehound.storeEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "tracehound.storeSecretName" .ctx }}
      key: {{ include "tracehound.storeSecretKey" .ctx }}
{{- end }}

{{/* The Secret holding the global alert receivers file, or nothing when there is none. */}}
{{- define "tracehound.alertsSecretName" -}}
{{- if .Values.operator.alerts.existingSecret }}
{{- .Values.operator.alerts.existingSecret }}
{{- else if .Values.operator.alerts.receivers }}
{{- printf "%s-alerts" (include "tracehound.fullname" .) }}
{{- end }}
{{- end }}

{{- define "tracehound.alertsSecretKey" -}}
{{- if .Values.operator.alerts.existingSecret }}{{ .Values.operator.alerts.existingSecretKey }}{{ else }}alerts.yaml{{ end }}
{{- end }}

{{/* The node agent container the operator injects into every rank pod (a native sidecar:
restartPolicy Always), before it adds the pod's job, node and attempt. */}}
{{- define "tracehound.sidecar" -}}
name: tracehound-agent
image: {{ include "tracehound.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: [agent]
restartPolicy: Always
env:
  {{- include "tracehound.storeEnv" (dict "ctx" . "name" "TRACEHOUND_SINK") | nindent 2 }}
  - name: TRACEHOUND_AGENT_SOCKET
    value: /var/run/tracehound/agent.sock
  - name: TRACEHOUND_SPOOL_DIR
    value: /var/run/tracehound/spool
  {{- with .Values.sidecar.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
resources:
  {{- toYaml .Values.sidecar.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.sidecar.securityContext | nindent 2 }}
volumeMounts:
  - name: tracehound-run
    mountPath: /var/run/tracehound
{{- end }}

{{/* Pod-level settings every Tracehound pod shares. */}}
{{- define "tracehound.podCommon" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
