{{/* Names and labels. */}}
{{- define "tierserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tierserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tierserve.labels" -}}
{{ include "tierserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tierserve.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | toString) }}
{{- end -}}

{{/* A domain name as a Ray resource / group name fragment: nvl-a -> nvl_a. */}}
{{- define "tierserve.resourceName" -}}
{{- regexReplaceAll "[^A-Za-z0-9_]" . "_" -}}
{{- end -}}

{{/* Kubernetes CPU quantity from config.pools.num_cpus_per_worker (may be fractional). */}}
{{- define "tierserve.cpuQuantity" -}}
{{- $c := float64 . -}}
{{- if eq $c (floor $c) -}}{{ int64 $c }}{{- else -}}{{ printf "%dm" (int64 (mulf $c 1000)) }}{{- end -}}
{{- end -}}

{{- define "tierserve.rayTokenSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-token" (include "tierserve.fullname" .)) -}}
{{- end -}}

{{- define "tierserve.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "tierserve.fullname" .)) -}}
{{- end -}}

{{- define "tierserve.hasApiKeysSecret" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.create -}}true{{- end -}}
{{- end -}}

{{/* Environment shared by every Ray container: Ray's token on every one of them. */}}
{{- define "tierserve.env" -}}
- name: TIERSERVE_CONFIG
  value: /etc/tierserve/config.yaml
- name: TIERSERVE_K8S_NODE
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tierserve.rayTokenSecret" . }}
      key: auth_token
{{- end }}
{{- if .Values.securityContext.container.readOnlyRootFilesystem }}
# The root filesystem is read-only: kernel caches go to the writable cache volume.
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/triton" .Values.securityContext.cacheDir }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod and container security contexts. */}}
{{- define "tierserve.podSecurityContext" -}}
{{- toYaml .Values.securityContext.pod -}}
{{- end -}}

{{- define "tierserve.containerSecurityContext" -}}
{{- toYaml .Values.securityContext.container -}}
{{- end -}}

{{/* Volumes: called with (dict "root" $ "head" true|false); the API keys only on the head. */}}
{{- define "tierserve.volumes" -}}
{{- $root := .root -}}
- name: config
{{- if $root.Values.configInSecret }}
  secret:
    secretName: {{ include "tierserve.fullname" $root }}-config
{{- else }}
  configMap:
    name: {{ include "tierserve.fullname" $root }}-config
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
{{- if $root.Values.securityContext.container.readOnlyRootFilesystem }}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}
{{- if and .head (include "tierserve.hasApiKeysSecret" $root) }}
- name: api-keys
  secret:
    secretName: {{ include "tierserve.apiKeysSecret" $root }}
    # owner root, group fsGroup: readable by the Ray user, by nobody else
    defaultMode: 0440
{{- end }}
{{- if $root.Values.modelVolume.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $root.Values.modelVolume.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "tierserve.volumeMounts" -}}
{{- $root := .root -}}
- name: config
  mountPath: /etc/tierserve
  readOnly: true
- name: dshm
  mountPath: /dev/shm
{{- if $root.Values.securityContext.container.readOnlyRootFilesystem }}
# Ray writes its session (sockets, logs, spilled objects) under /tmp/ray.
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: {{ $root.Values.securityContext.cacheDir }}
{{- end }}
{{- if and .head (include "tierserve.hasApiKeysSecret" $root) }}
- name: api-keys
  mountPath: {{ $root.Values.apiKeys.mountPath }}
  readOnly: true
{{- end }}
{{- if $root.Values.modelVolume.claimName }}
- name: models
  mountPath: {{ $root.Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
One worker group. Called with (dict "root" $ "role" "prefill"|"decode" "domain" $d-or-nil
"replicas" N).
*/}}
{{- define "tierserve.workerGroup" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $pool := index $root.Values .role -}}
{{- $pools := $root.Values.config.pools -}}
{{- $gpus := int64 (ceil (float64 $pools.num_gpus_per_worker)) -}}
{{- $resources := dict (printf "tierserve_%s" $role) 1 -}}
{{- $labels := list (printf "tierserve.io/role=%s" $role) "tierserve.io/k8s-node=$(TIERSERVE_K8S_NODE)" -}}
{{- $nodeSelector := deepCopy ($pool.nodeSelector | default dict) -}}
{{- $group := $role -}}
{{- if .domain -}}
{{- $group = printf "%s-%s" $role .domain.name -}}
{{- $_ := set $resources (printf "tierserve_domain_%s" (include "tierserve.resourceName" .domain.name)) 1 -}}
{{- $labels = append $labels (printf "tierserve.io/nvlink-domain=%s" .domain.name) -}}
{{- $_ := set $nodeSelector $root.Values.topology.nodeLabel (.domain.labelValue | toString) -}}
{{- end -}}
- groupName: {{ $group }}
  replicas: {{ .replicas }}
  minReplicas: {{ .replicas }}
  maxReplicas: {{ .replicas }}
  rayStartParams:
    # `ray start` takes whole numbers; a fractional worker still fits on the node.
    num-cpus: {{ int64 (ceil (float64 $pools.num_cpus_per_worker)) | toString | quote }}
    num-gpus: {{ $gpus | toString | quote }}
    resources: {{ printf "\"%s\"" (replace "\"" "\\\"" ($resources | toJson)) | squote }}
    labels: {{ join "," $labels | quote }}
    {{- range $k, $v := $pool.rayStartParams }}
    {{ $k }}: {{ $v | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "tierserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $role }}
        tierserve.io/role: {{ $role }}
        {{- if .domain }}
        tierserve.io/nvlink-domain: {{ .domain.name }}
        {{- end }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    spec:
      securityContext:
        {{- include "tierserve.podSecurityContext" $root | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "tierserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          securityContext:
            {{- include "tierserve.containerSecurityContext" $root | nindent 12 }}
          env:
            {{- include "tierserve.env" $root | nindent 12 }}
            - name: TIERSERVE_ROLE
              value: {{ $role }}
            {{- if .domain }}
            - name: TIERSERVE_NVLINK_DOMAIN
              value: {{ .domain.name | quote }}
            {{- end }}
          resources:
            requests:
              cpu: {{ include "tierserve.cpuQuantity" $pools.num_cpus_per_worker | quote }}
              memory: {{ $pool.memory }}
              {{- if gt $gpus 0 }}
              nvidia.com/gpu: {{ $gpus | quote }}
              {{- end }}
            limits:
              cpu: {{ include "tierserve.cpuQuantity" $pools.num_cpus_per_worker | quote }}
              memory: {{ $pool.memory }}
              {{- if gt $gpus 0 }}
              nvidia.com/gpu: {{ $gpus | quote }}
              {{- end }}
          volumeMounts:
            {{- include "tierserve.volumeMounts" (dict "root" $root "head" false) | nindent 12 }}
      volumes:
        {{- include "tierserve.volumes" (dict "root" $root "head" false) | nindent 8 }}
{{- end -}}

{{/*
Keys only where they are checked, from a Secret: tenants name a file under
apiKeys.mountPath (the Secret, mounted on the head pod only, where the router runs; the
router re-reads it when the Secret changes). Keys listed in values would land in a
ConfigMap and the release history, and api_keys_env would put them in every Ray
container's environment: both are refused.
*/}}
{{- define "tierserve.checkKeys" -}}
{{- $mount := trimSuffix "/" .Values.apiKeys.mountPath -}}
{{- range $i, $t := (.Values.config.tenants | default list) -}}
{{- if $t.api_keys -}}
{{- fail (printf "config.tenants[%d].api_keys: keys in values end up in a ConfigMap and the Helm release; put them in a Secret (apiKeys.existingSecret, or apiKeys.create with apiKeys.keys) and set api_keys_file: %s/<key in the Secret>" $i $mount) -}}
{{- end -}}
{{- if $t.api_keys_env -}}
{{- fail (printf "config.tenants[%d].api_keys_env: an environment variable reaches every Ray container, not only the router; use api_keys_file: %s/<key in the Secret> with apiKeys.existingSecret" $i $mount) -}}
{{- end -}}
{{- with $t.api_keys_file -}}
{{- if not (hasPrefix (printf "%s/" $mount) (toString .)) -}}
{{- fail (printf "config.tenants[%d].api_keys_file %s: only the API keys Secret is mounted on the router's pod, at apiKeys.mountPath %s; name a file there" $i . $mount) -}}
{{- end -}}
{{- if not (include "tierserve.hasApiKeysSecret" $) -}}
{{- fail (printf "config.tenants[%d].api_keys_file %s: no Secret to mount there; set apiKeys.existingSecret (or apiKeys.create with apiKeys.keys)" $i .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.apiKeys.create .Values.apiKeys.existingSecret -}}
{{- fail "apiKeys: set existingSecret or create, not both" -}}
{{- end -}}
{{- end -}}

{{/*
Open access (no tenant with a key file) on an address other than loopback renders only
when config.router.allow_open_access says so: the chart's default host, 0.0.0.0, is the
cluster network, and serveConfigV2 binds exactly config.router.host. The config loader
refuses the same tree (cluster/config.py).
*/}}
{{- define "tierserve.checkAccess" -}}
{{- include "tierserve.checkKeys" . -}}
{{- $router := .Values.config.router -}}
{{- $keyed := false -}}
{{- range (.Values.config.tenants | default list) -}}
{{- if or .api_keys_file .api_key_digests -}}{{- $keyed = true -}}{{- end -}}
{{- end -}}
{{- if and (not $keyed) (not (include "tierserve.isLoopback" $router.host)) (not $router.allow_open_access) -}}
{{- fail (printf "config.router.host %s with no API key in config.tenants would serve anyone on the network: give a tenant api_keys_file (a key of the apiKeys Secret), or set config.router.allow_open_access=true to serve without keys" (toString $router.host)) -}}
{{- end -}}
{{- end -}}

{{- define "tierserve.isLoopback" -}}
{{- $host := toString . -}}
{{- if or (eq $host "localhost") (eq $host "::1") (hasPrefix "127." $host) -}}true{{- end -}}
{{- end -}}

{{/* Where the head's probes reach the router: loopback when it binds every address. */}}
{{- define "tierserve.probeHost" -}}
{{- $host := toString . -}}
{{- if or (eq $host "0.0.0.0") (eq $host "::") (eq $host "") -}}127.0.0.1{{- else -}}{{ $host }}{{- end -}}
{{- end -}}

{{/*
Ray's dashboard takes job submissions (code execution) and KubeRay needs it on the pod
network to deploy Serve: it is served only behind Ray's token (rayAuth), unless the
operator says otherwise.
*/}}
{{- define "tierserve.checkRayAuth" -}}
{{- if and (not .Values.rayAuth.enabled) (not .Values.rayAuth.allowUnauthenticated) -}}
{{- fail "rayAuth.enabled=false leaves Ray's dashboard (job submission runs code), GCS and client ports unauthenticated on the pod network, where KubeRay needs the dashboard; set rayAuth.allowUnauthenticated=true to accept that (the NetworkPolicy still limits who reaches them)" -}}
{{- end -}}
{{- if .Values.head.rayStartParams.resources -}}
{{- fail "head.rayStartParams.resources: the chart sets the head's Ray resources (tierserve_router places the router, which holds the keys, on the head)" -}}
{{- end -}}
{{- end -}}
