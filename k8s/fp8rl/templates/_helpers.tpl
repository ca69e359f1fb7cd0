{{/* Names, labels, images, the shared pod pieces and the values checks of the fp8rl chart. */}}

{{- define "fp8rl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or <release> when it already holds the chart name; 63 characters at most. */}}
{{- define "fp8rl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's resources: fp8rl.component (dict "root" $ "component" "trainer"). */}}
{{- define "fp8rl.component" -}}
{{- printf "%s-%s" (include "fp8rl.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "fp8rl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fp8rl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fp8rl.labels" -}}
{{ include "fp8rl.selectorLabels" . }}
app.kubernetes.io/part-of: fp8rl
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Every pod of this release: what the NetworkPolicies admit. */}}
{{- define "fp8rl.releasePods" -}}
app.kubernetes.io/name: {{ include "fp8rl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Image of a role: fp8rl.image (dict "root" $ "role" "rollout" "variant" "gpu"). */}}
{{- define "fp8rl.image" -}}
{{- $img := .root.Values.image -}}
{{- $repo := ternary (printf "%s/%s" $img.registry $img.repository) $img.repository (ne $img.registry "") -}}
{{- printf "%s/%s:%s-%s" $repo .role (default .root.Chart.AppVersion $img.tag) (default "cpu" .variant) -}}
{{- end -}}

{{- define "fp8rl.serviceSecretName" -}}
{{- default (include "fp8rl.component" (dict "root" . "component" "service-token")) .Values.auth.existingServiceSecret -}}
{{- end -}}

{{- define "fp8rl.clientSecretName" -}}
{{- default (include "fp8rl.component" (dict "root" . "component" "client-token")) .Values.auth.existingClientSecret -}}
{{- end -}}

{{- define "fp8rl.redisSecretName" -}}
{{- if .Values.redis.bundled -}}
{{- default (include "fp8rl.component" (dict "root" . "component" "redis")) .Values.redis.existingSecret -}}
{{- else -}}
{{- default (include "fp8rl.component" (dict "root" . "component" "redis")) .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* A value kept across upgrades: the existing Secret's key when there is one, else the given or a new random one. */}}
{{- define "fp8rl.stableSecret" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if .given -}}
{{- .given -}}
{{- else if and $existing (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}

{{/* Pod-level security: non-root uid 10001 (the images' user), RuntimeDefault seccomp. */}}
{{- define "fp8rl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "fp8rl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/*
Environment shared by the roles that run on services/common/runtime.py. Secrets are referenced, never
inlined: the Redis URL is composed by Kubernetes from $(FP8RL_REDIS_PASSWORD) at container start.
*/}}
{{- define "fp8rl.env" -}}
- name: FP8RL_CONFIG
  value: /etc/fp8rl/job.yaml
- name: FP8RL_JOB_ID
  value: {{ .Values.jobId | quote }}
- name: FP8RL_TORCH_THREADS
  value: {{ .Values.torchThreads | quote }}
- name: FP8RL_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
- name: FP8RL_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if .Values.metrics.enabled }}
- name: FP8RL_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: FP8RL_METRICS_HOST
  value: "0.0.0.0"
{{- end }}
{{- if .Values.redis.bundled }}
- name: FP8RL_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "fp8rl.redisSecretName" . }}
      key: redis-password
- name: FP8RL_REDIS_URL
  value: {{ printf "redis://:$(FP8RL_REDIS_PASSWORD)@%s:6379/0" (include "fp8rl.component" (dict "root" . "component" "redis")) | quote }}
{{- else }}
- name: FP8RL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "fp8rl.redisSecretName" . }}
      key: {{ ternary .Values.redis.external.existingSecretKey "redis-url" (ne .Values.redis.external.existingSecret "") }}
{{- end }}
{{ include "fp8rl.authEnv" . }}
{{- end -}}

{{/*
Both tokens, to every role: each service requires the service token and sends it on its own calls; the controller
requires the client token on its JobService; the others know it only to answer its holder PERMISSION_DENIED.
*/}}
{{- define "fp8rl.authEnv" -}}
- name: FP8RL_SERVICE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "fp8rl.serviceSecretName" . }}
      key: token
- name: FP8RL_CLIENT_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "fp8rl.clientSecretName" . }}
      key: token
{{- if .Values.tls.enabled }}
- name: FP8RL_TLS_CERT
  value: /etc/fp8rl/tls/tls.crt
- name: FP8RL_TLS_KEY
  value: /etc/fp8rl/tls/tls.key
- name: FP8RL_TLS_CA
  value: /etc/fp8rl/tls/ca.crt
{{- end }}
{{- end -}}

{{/*
Probes of one gRPC port: fp8rl.probes (dict "root" $ "port" 50051 "startupSeconds" 600 "liveness" "grpc").
Native gRPC probes (kubelet's grpc.health.v1 client) when plaintext; with TLS, which kubelet's gRPC probe does
not speak, the image's exec health probe. liveness "tcp" is for rollout replicas: they are NOT_SERVING until
the first job calibrates version 0, and an idle replica must not be restarted for that.
*/}}
{{- define "fp8rl.probes" -}}
{{- $check := dict "grpc" (dict "port" .port) -}}
{{- if .root.Values.tls.enabled -}}
{{- $check = dict "exec" (dict "command" (list "python" "-m" "fp8rl.rpc.health_probe" (printf "localhost:%v" .port))) -}}
{{- end -}}
{{- $tcp := dict "tcpSocket" (dict "port" .port) -}}
{{- $live := ternary $tcp $check (eq (default "grpc" .liveness) "tcp") -}}
startupProbe:
  {{- toYaml $live | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div .startupSeconds 10 }}
livenessProbe:
  {{- toYaml $live | nindent 2 }}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
{{- end -}}

{{/* GPU resources merged into a role's resources: fp8rl.resources (dict "resources" .Values.x.resources "gpus" N). */}}
{{- define "fp8rl.resources" -}}
{{- $r := deepCopy (default dict .resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $_ := set $r "requests" (merge (dict "nvidia.com/gpu" (int .gpus)) (default dict $r.requests)) -}}
{{- $_ := set $r "limits" (merge (dict "nvidia.com/gpu" (int .gpus)) (default dict $r.limits)) -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* Volumes every model-loading role mounts: the job file, /tmp, the model cache and (TLS) the certificates. */}}
{{- define "fp8rl.volumes" -}}
- name: job
  configMap:
    name: {{ include "fp8rl.component" (dict "root" . "component" "job") }}
- name: tmp
  emptyDir: {}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end -}}

{{- define "fp8rl.volumeMounts" -}}
- name: job
  mountPath: /etc/fp8rl/job.yaml
  subPath: job.yaml
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: model-cache
  mountPath: /var/cache/fp8rl
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/fp8rl/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Checks the render fails on, each with the value to change. Included by templates/validate.yaml.
*/}}
{{- define "fp8rl.validate" -}}
{{- $v := .Values -}}
{{- if and (not $v.redis.bundled) (not $v.redis.external.url) (not $v.redis.external.existingSecret) -}}
{{- fail "redis.bundled is false, so fp8rl needs an external Redis: set redis.external.url (redis://[:password@]host:port/db) or redis.external.existingSecret" -}}
{{- end -}}
{{- if and $v.redis.bundled (or $v.redis.external.url $v.redis.external.existingSecret) -}}
{{- fail "redis.external.* is set while redis.bundled is true: set redis.bundled=false to use the external Redis, or drop redis.external" -}}
{{- end -}}
{{- if and $v.auth.serviceToken (eq $v.auth.serviceToken $v.auth.clientToken) -}}
{{- fail "auth.serviceToken equals auth.clientToken: give each scope its own token (or leave both empty to generate them), or a client-token holder could call the internal RPCs" -}}
{{- end -}}
{{- if and $v.auth.existingServiceSecret (eq $v.auth.existingServiceSecret $v.auth.existingClientSecret) -}}
{{- fail "auth.existingServiceSecret and auth.existingClientSecret name the same Secret: each scope needs its own Secret (key `token`)" -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.secretName) -}}
{{- fail "tls.enabled is true but tls.secretName is empty: name a kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt" -}}
{{- end -}}
{{- $gen := dig "policy" "generation" "backend" "torch" $v.job -}}
{{- if and (eq $gen "vllm") (or (ne $v.rollout.variant "gpu") (lt (int $v.rollout.gpus) 1)) -}}
{{- fail (printf "job.policy.generation.backend is vllm, which needs GPU rollout replicas: set rollout.variant=gpu and rollout.gpus>=1 (have variant=%s, gpus=%v)" $v.rollout.variant $v.rollout.gpus) -}}
{{- end -}}
{{- $train := dig "policy" "training" "backend" "torch" $v.job -}}
{{- if and (eq $train "megatron") (or (ne $v.trainer.variant "gpu") (lt (int $v.trainer.gpus) 1)) -}}
{{- fail (printf "job.policy.training.backend is megatron, which needs a GPU trainer: set trainer.variant=gpu and trainer.gpus>=1 (have variant=%s, gpus=%v)" $v.trainer.variant $v.trainer.gpus) -}}
{{- end -}}
{{- $dp := int (dig "policy" "training" "dp_size" 1 $v.job) -}}
{{- $mp := 1 -}}
{{- if eq $train "megatron" -}}
{{- $mp = mul (int (dig "policy" "training" "megatron_cfg" "tensor_model_parallel_size" 1 $v.job)) (int (dig "policy" "training" "megatron_cfg" "pipeline_model_parallel_size" 1 $v.job)) -}}
{{- end -}}
{{- $ep := int (dig "policy" "training" "megatron_cfg" "expert_model_parallel_size" 1 $v.job) -}}
{{- if and (gt $ep 1) (ne (mod $dp $ep) 0) -}}
{{- fail (printf "job.policy.training.megatron_cfg.expert_model_parallel_size is %d but dp_size is %d: expert parallelism runs inside the data-parallel ranks (it adds none), so it must divide dp_size" $ep $dp) -}}
{{- end -}}
{{- $want := mul $dp $mp -}}
{{- $world := mul (int $v.trainer.pods) (int $v.trainer.procsPerPod) -}}
{{- if and (ne $want $world) (eq $mp 1) -}}
{{- fail (printf "job.policy.training.dp_size is %d but trainer.pods x trainer.procsPerPod is %d x %d = %d: the trainer refuses a rank count other than dp_size; make them equal" $dp (int $v.trainer.pods) (int $v.trainer.procsPerPod) $world) -}}
{{- end -}}
{{- if ne $want $world -}}
{{- fail (printf "job.policy.training.dp_size x megatron_cfg tensor x pipeline parallel size is %d x %d = %d ranks but trainer.pods x trainer.procsPerPod is %d x %d = %d: the trainer refuses any other rank count; make them equal" $dp $mp $want (int $v.trainer.pods) (int $v.trainer.procsPerPod) $world) -}}
{{- end -}}
{{- if and (gt (int $v.trainer.pods) 1) (not $v.trainer.checkpoints.existingClaim) -}}
{{- fail (printf "trainer.pods is %d: every rank writes its checkpoint shards into one directory, so set trainer.checkpoints.existingClaim to a ReadWriteMany claim they all mount" (int $v.trainer.pods)) -}}
{{- end -}}
{{- if and $v.rollout.pdb.enabled (le (int $v.rollout.replicas) (int $v.rollout.pdb.maxUnavailable)) (gt (int $v.rollout.replicas) 1) -}}
{{- fail (printf "rollout.pdb.maxUnavailable=%v would let a drain take every one of the %v rollout replicas: lower it below rollout.replicas" $v.rollout.pdb.maxUnavailable $v.rollout.replicas) -}}
{{- end -}}
{{- end -}}
