{{/*
Names. Kubernetes names are at most 63 characters; the RayCluster name is
kept shorter because KubeRay derives longer names from it
(<name>-head-svc, <name>-<group>-worker-<suffix>).
*/}}
{{- define "kuangchao.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kuangchao.fullname" -}}
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

{{- define "kuangchao.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kuangchao.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuangchao.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kuangchao.labels" -}}
helm.sh/chart: {{ include "kuangchao.chart" . }}
{{ include "kuangchao.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kuangchao
{{- end }}

{{/* Selector labels of one component: api, ray, redis. */}}
{{- define "kuangchao.componentSelector" -}}
{{ include "kuangchao.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kuangchao.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "kuangchao.rayClusterName" -}}
{{- $n := include "kuangchao.fullname" . | trunc 40 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]" $n) }}
{{- fail (printf "the RayCluster name %q must start with a letter (a DNS-1035 label): use a release name that does, or set fullnameOverride" $n) }}
{{- end }}
{{- $n }}
{{- end }}

{{/* The head Service KubeRay creates for a RayCluster: <cluster>-head-svc. */}}
{{- define "kuangchao.rayHeadHost" -}}
{{- printf "%s-head-svc.%s.svc.%s" (include "kuangchao.rayClusterName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "kuangchao.apiName" -}}
{{- printf "%s-api" (include "kuangchao.fullname" . | trunc 59 | trimSuffix "-") }}
{{- end }}

{{- define "kuangchao.redisName" -}}
{{- printf "%s-redis" (include "kuangchao.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "kuangchao.serviceAccountName" -}}
{{- if .Values.api.serviceAccount.create }}
{{- default (include "kuangchao.apiName" .) .Values.api.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.api.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Redis is bundled unless an external one is named. */}}
{{- define "kuangchao.redisBundled" -}}
{{- if not (or .Values.redis.external.url .Values.redis.external.existingSecret) }}true{{ end }}
{{- end }}

{{/* The Secret and key holding the admin Redis URL (KC_REDIS_URL). */}}
{{- define "kuangchao.redisUrlSecretName" -}}
{{- .Values.redis.external.existingSecret | default (include "kuangchao.redisName" .) }}
{{- end }}
{{- define "kuangchao.redisUrlSecretKey" -}}
{{- if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* The Secret holding signing-key.pem, admin-key and metrics-token. */}}
{{- define "kuangchao.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "kuangchao.fullname" . | trunc 55 | trimSuffix "-")) }}
{{- end }}

{{/*
Every generated secret, decided once per render and shared by all templates:
the Secret that stores a value, the scrape config that repeats the metrics
token and the checksums that restart pods must all see the same value, and
generators return a new one on each call. Helm hands every template the same
.Values map, so the first caller stores the result there.
Order: the value given in values, else the value in the release's existing
Secret (lookup: what keeps secrets stable across `helm upgrade`; it finds
nothing in `helm template`/lint), else a fresh one.
*/}}
{{- define "kuangchao.secretValues" -}}
{{- if not (hasKey .Values "__kcSecrets") }}
{{- $ns := .Release.Namespace }}
{{- $old := dict }}
{{- if not .Values.secrets.existingSecret }}
{{- $found := lookup "v1" "Secret" $ns (include "kuangchao.secretName" .) }}
{{- if $found }}{{ $old = $found.data | default dict }}{{ end }}
{{- end }}
{{- $oldRedis := dict }}
{{- $foundRedis := lookup "v1" "Secret" $ns (include "kuangchao.redisName" .) }}
{{- if $foundRedis }}{{ $oldRedis = $foundRedis.data | default dict }}{{ end }}
{{- $s := dict }}
{{- $_ := set $s "signingKey" (.Values.secrets.signingKey | default (get $old "signing-key.pem" | b64dec) | default (genPrivateKey "ed25519")) }}
{{- $genAdmin := printf "kc_%s_%s" (randAlphaNum 32 | sha256sum | trunc 16) (randAlphaNum 43) }}
{{- $_ = set $s "adminKey" (.Values.secrets.adminKey | default (get $old "admin-key" | b64dec) | default $genAdmin) }}
{{- $_ = set $s "metricsToken" (.Values.secrets.metricsToken | default (get $old "metrics-token" | b64dec) | default (randAlphaNum 48)) }}
{{- $_ = set $s "rayToken" (.Values.secrets.rayToken | default (get $old "ray-token" | b64dec) | default (randAlphaNum 48)) }}
{{- $_ = set $s "redisPassword" (.Values.redis.password | default (get $oldRedis "password" | b64dec) | default (randAlphaNum 32)) }}
{{- $_ = set .Values "__kcSecrets" $s }}
{{- end }}
{{- toJson .Values.__kcSecrets }}
{{- end }}

{{/* The admin Redis URL of the bundled Redis or of external.url. */}}
{{- define "kuangchao.redisUrl" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.url }}
{{- else }}
{{- $s := include "kuangchao.secretValues" . | fromJson }}
{{- printf "redis://%s:%s@%s.%s.svc.%s:6379/0" .Values.redis.adminUser $s.redisPassword (include "kuangchao.redisName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}
{{- end }}

{{/*
Checksums in pod annotations, so that `helm upgrade` with a changed secret
restarts exactly the pods that read it (environment variables and files read
once at start do not follow a Secret). A Secret the chart does not manage
contributes only its name: rotate those with a rollout restart.
*/}}
{{- define "kuangchao.checksumRedis" -}}
{{- if .Values.redis.external.existingSecret }}
{{- printf "%s/%s" .Values.redis.external.existingSecret .Values.redis.external.existingSecretKey | sha256sum }}
{{- else }}
{{- include "kuangchao.redisUrl" . | sha256sum }}
{{- end }}
{{- end }}

{{/* Args: dict "ctx" $ "key" "signingKey"|"adminKey"|"metricsToken". */}}
{{- define "kuangchao.checksumKey" -}}
{{- if .ctx.Values.secrets.existingSecret }}
{{- .ctx.Values.secrets.existingSecret | sha256sum }}
{{- else }}
{{- $s := include "kuangchao.secretValues" .ctx | fromJson }}
{{- get $s .key | sha256sum }}
{{- end }}
{{- end }}

{{/* Pod- and container-level least privilege, shared by every kuangchao pod. */}}
{{- define "kuangchao.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
# Large checkpoint volumes: chown only when the root's owner is wrong.
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Args: dict "readOnly" bool. No capability is added back: a non-root
process would not get it in its effective set anyway. */}}
{{- define "kuangchao.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ .readOnly | default false }}
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Checks the schema cannot express; each message names the value to fix. */}}
{{- define "kuangchao.validate" -}}
{{- if and .Values.redis.external.url .Values.redis.external.existingSecret }}
{{- fail "redis.external: set url or existingSecret, not both" }}
{{- end }}
{{- if and .Values.secrets.existingSecret (or .Values.secrets.signingKey .Values.secrets.adminKey .Values.secrets.metricsToken .Values.secrets.rayToken) }}
{{- fail "secrets: with secrets.existingSecret, leave signingKey, adminKey, metricsToken and rayToken empty (they live in that Secret)" }}
{{- end }}
{{- if and (include "kuangchao.objectStoreEnabled" .) (not .Values.objectStore.existingSecret) }}
{{- fail "objectStore.existingSecret: name a Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optionally AWS_SESSION_TOKEN): the credentials the API and the token authority use for objectStore.url" }}
{{- end }}
{{- $urls := dict }}
{{- with .Values.objectStore.url }}{{ $_ := set $urls "objectStore.url" . }}{{ end }}
{{- range $i, $u := .Values.objectStore.dataUrls }}{{ $_ := set $urls (printf "objectStore.dataUrls[%d]" $i) $u }}{{ end }}
{{- range $field, $u := $urls }}
{{- if regexMatch "^(?i)(file|local)://" $u }}
{{- fail (printf "%s: %q names this machine's files; give an object-store URL (s3://bucket/prefix), or use checkpoints.existingClaim for a shared volume" $field $u) }}
{{- end }}
{{- if regexMatch `^[^:]+://[^/]+/(.*/)?\.\.?(/.*)?$|^[^:]+://[^/]+/(.*/)?/` $u }}
{{- fail (printf "%s: %q has an empty, '.' or '..' segment; write the prefix plainly (s3://bucket/a/b)" $field $u) }}
{{- end }}
{{- end }}
{{- if and .Values.objectStore.roleArn (eq .Values.objectStore.credentialsMode "shared") }}
{{- fail "objectStore.roleArn is used only with credentialsMode scoped (the authority assumes it for each job); with shared, ranks get the Secret's keys as they are: leave roleArn empty" }}
{{- end }}
{{- $seen := dict }}
{{- range $i, $g := .Values.ray.workerGroups }}
{{- if hasKey $seen $g.name }}
{{- fail (printf "ray.workerGroups[%d].name: %q is used twice; group names must be unique" $i $g.name) }}
{{- end }}
{{- $_ := set $seen $g.name true }}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) }}
{{- fail (printf "ray.workerGroups[%d] (%s): minReplicas %d is above maxReplicas %d" $i $g.name (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) }}
{{- fail (printf "ray.workerGroups[%d] (%s): replicas %d must lie between minReplicas %d and maxReplicas %d" $i $g.name (int $g.replicas) (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- if and $g.nvlink (not (int $g.gpus)) }}
{{- fail (printf "ray.workerGroups[%d] (%s): nvlink %q needs gpus > 0" $i $g.name $g.nvlink) }}
{{- end }}
{{- if and $g.nvlink (ne $g.nvlink "full") (ne (len (splitList "." (replace "_" "." $g.nvlink))) (int $g.gpus)) }}
{{- fail (printf "ray.workerGroups[%d] (%s): nvlink %q names %d GPUs but gpus is %d; list every GPU id once" $i $g.name $g.nvlink (len (splitList "." (replace "_" "." $g.nvlink))) (int $g.gpus)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Ray's token authentication (RAY_AUTH_MODE=token), set on every container that
runs or talks to Ray: the head, the control-plane container, the workers and
the API. The chart sets the variables itself, not through KubeRay's
authOptions, so that the containers KubeRay does not manage (the control
plane's, the API's) present the same token, whatever the KubeRay version.
The token is a file (key ray-token of the chart's Secret), not a variable.
*/}}
{{- define "kuangchao.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN_PATH
  value: /etc/kuangchao/ray-auth/ray-token
{{- end }}
{{- define "kuangchao.rayAuthMount" -}}
- name: ray-token
  mountPath: /etc/kuangchao/ray-auth
  readOnly: true
{{- end }}
{{- define "kuangchao.rayAuthVolume" -}}
- name: ray-token
  secret:
    secretName: {{ include "kuangchao.secretName" . }}
    defaultMode: 0440
    items:
      - key: ray-token
        path: ray-token
{{- end }}

{{/*
Object storage for checkpoints and data (values.yaml, objectStore). On when
objectStore.url or objectStore.dataUrls is set.
*/}}
{{- define "kuangchao.objectStoreEnabled" -}}
{{- if or .Values.objectStore.url .Values.objectStore.dataUrls }}true{{ end }}
{{- end }}

{{/*
The object-store settings that are not secret: which URL prefixes jobs may
name, how ranks get credentials, and where the store is. Set on the API, the
head and the control-plane container; never on a worker (ranks get their
job's credentials, endpoint and region from the token authority).
*/}}
{{- define "kuangchao.objectStoreEnv" -}}
{{- $o := .Values.objectStore }}
{{- with $o.url }}
- name: KC_CHECKPOINT_URLS
  value: {{ . | quote }}
{{- end }}
{{- with $o.dataUrls }}
- name: KC_DATA_URLS
  value: {{ join "," . | quote }}
{{- end }}
- name: KC_OBJECT_STORE_CREDENTIALS
  value: {{ $o.credentialsMode | quote }}
{{- with $o.roleArn }}
- name: KC_OBJECT_STORE_ROLE_ARN
  value: {{ . | quote }}
{{- end }}
{{- with $o.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $o.region }}
- name: AWS_REGION
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
The operator's object-store keys, from objectStore.existingSecret: only the
API and the control-plane container get them. Not the head's raylet (every
worker and driver on the head inherits its environment), not a worker.
*/}}
{{- define "kuangchao.objectStoreSecretEnv" -}}
{{- $s := .Values.objectStore.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $s }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $s }}
      key: AWS_SECRET_ACCESS_KEY
- name: AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $s }}
      key: AWS_SESSION_TOKEN
      optional: true
{{- end }}

{{/*
On the Ray containers (the raylets): botocore finds no credentials of the node
to fall back on, neither a file nor the instance's role, so a process Ray
starts uses the credentials its job was granted or none.
*/}}
{{- define "kuangchao.noAmbientAwsEnv" -}}
- name: AWS_EC2_METADATA_DISABLED
  value: "true"
- name: AWS_SHARED_CREDENTIALS_FILE
  value: /dev/null
- name: AWS_CONFIG_FILE
  value: /dev/null
{{- end }}

{{/*
The bundled Redis's limits, sized for the largest cluster the values declare
(docs/operator-guide.md, "Redis sizing"). The same integer steps as
platform/jobs/redis_sizing.py `sizing`, whose constants these are
(tests/deploy/test_helm_chart.py renders several clusters and compares):
rank slots are each pod's GPUs, or its CPUs on a CPU-only group, times the
group's pods (maxReplicas with the autoscaler on); 8 connections per slot (a
rank's 5 and a controller's 3), 6 for the control plane, 42 per API replica;
twice that plus 64, never below Redis's default of 10000. Memory: 15893216
bytes per slot (a job's capped logs, events and curve, and a rank's keys),
8454144 per node (a link probe), 167108864 fixed (the audit stream and
control keys), 32768 per connection; times 3/2, in whole 256 MB steps, never
below 2 GB. redis.maxclients / redis.maxmemory, when set, win.
Output: JSON {slots, nodes, clients, maxclients, nofile, maxmemory} (maxmemory
as redis.conf writes it).
*/}}
{{- define "kuangchao.redisSizing" -}}
{{- $slots := 0 }}
{{- $nodes := 0 }}
{{- range $g := .Values.ray.workerGroups }}
{{- $pods := ternary (int $g.maxReplicas) (int $g.replicas) $.Values.ray.autoscaling.enabled }}
{{- $perPod := ternary (int $g.gpus) (int $g.cpu) (gt (int $g.gpus) 0) }}
{{- $slots = add $slots (mul $pods $perPod) }}
{{- $nodes = add $nodes $pods }}
{{- end }}
{{- $clients := add (mul $slots 9) 6 (mul (int .Values.api.replicas) 42) }}
{{- $maxclients := max 10000 (add (mul $clients 2) 64) }}
{{- with .Values.redis.maxclients }}{{ $maxclients = int . }}{{ end }}
{{- $need := add (mul $slots 15893216) (mul $nodes 8454144) 167108864 (mul $clients 32768) }}
{{- $step := 268435456 }}
{{- $steps := div (add (mul $need 3) (sub (mul 2 $step) 1)) (mul 2 $step) }}
{{- $mb := div (max 2147483648 (mul $steps $step)) 1048576 }}
{{- $maxmemory := .Values.redis.maxmemory | default (printf "%dmb" $mb) }}
{{- dict "slots" $slots "nodes" $nodes "clients" $clients "maxclients" $maxclients
      "nofile" (add $maxclients 128) "maxmemory" $maxmemory | toJson }}
{{- end }}
