{{/*
The pod template every fp8rl role shares:
  fp8rl.pod (dict "root" $ "component" "trainer" "cfg" .Values.trainer "port" 50051
                  "command" (list ...) "args" (list ...) "env" (list ...) "mounts" (list ...) "volumes" (list ...)
                  "liveness" "grpc")
*/}}
{{- define "fp8rl.pod" -}}
{{- $root := .root -}}
{{- $cfg := .cfg -}}
metadata:
  labels:
    {{- include "fp8rl.labels" (dict "root" $root "component" .component) | nindent 4 }}
  annotations:
    checksum/job: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum | trunc 16 }}
    {{- if and $root.Values.metrics.enabled $root.Values.metrics.podAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $root.Values.metrics.port | quote }}
    prometheus.io/path: /metrics
    {{- end }}
spec:
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: 60
  securityContext:
    {{- include "fp8rl.podSecurityContext" $root | nindent 4 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "fp8rl.image" (dict "root" $root "role" .component "variant" $cfg.variant) }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- with .command }}
      command:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .args }}
      args:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        - name: FP8RL_PORT
          value: {{ .port | quote }}
        {{- include "fp8rl.env" $root | nindent 8 }}
        {{- with .env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ .port }}
          protocol: TCP
        {{- if $root.Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ $root.Values.metrics.port }}
          protocol: TCP
        {{- end }}
      {{- include "fp8rl.probes" (dict "root" $root "port" .port "startupSeconds" (int $cfg.startupSeconds) "liveness" .liveness) | nindent 6 }}
      securityContext:
        {{- include "fp8rl.containerSecurityContext" $root | nindent 8 }}
      resources:
        {{- include "fp8rl.resources" (dict "resources" $cfg.resources "gpus" (default 0 $cfg.gpus)) | nindent 8 }}
      volumeMounts:
        {{- include "fp8rl.volumeMounts" $root | nindent 8 }}
        {{- with .mounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- include "fp8rl.volumes" $root | nindent 4 }}
    {{- with .volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* ClusterIP Service of one role: fp8rl.service (dict "root" $ "component" "trainer" "port" 50051); optional
"name" (default: the component's), "selector" (extra labels), "extraPorts", "headless", "publishNotReady". */}}
{{- define "fp8rl.service" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ default (include "fp8rl.component" .) .name }}
  labels:
    {{- include "fp8rl.labels" . | nindent 4 }}
spec:
  type: {{ default "ClusterIP" .type }}
  {{- if .headless }}
  clusterIP: None
  {{- end }}
  {{- if .publishNotReady }}
  publishNotReadyAddresses: true
  {{- end }}
  selector:
    {{- include "fp8rl.selectorLabels" . | nindent 4 }}
    {{- with .selector }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    {{- with .extraPorts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    - name: grpc
      port: {{ default .port .servicePort }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if .root.Values.metrics.enabled }}
    - name: metrics
      port: {{ .root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end -}}
