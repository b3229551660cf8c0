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

{{/* Environment shared by every Ray container. */}}
{{- define "tierserve.env" -}}
- name: TIERSERVE_CONFIG
  value: /etc/tierserve/config.yaml
- name: TIERSERVE_K8S_NODE
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tierserve.volumes" -}}
- name: config
{{- if .Values.configInSecret }}
  secret:
    secretName: {{ include "tierserve.fullname" . }}-config
{{- else }}
  configMap:
    name: {{ include "tierserve.fullname" . }}-config
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
{{- if .Values.modelVolume.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelVolume.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "tierserve.volumeMounts" -}}
- name: config
  mountPath: /etc/tierserve
  readOnly: true
- name: dshm
  mountPath: /dev/shm
{{- if .Values.modelVolume.claimName }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
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
            {{- include "tierserve.volumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "tierserve.volumes" $root | nindent 8 }}
{{- end -}}

{{/*
Open access (no tenant with an API key) on an address other than loopback renders only
when config.router.allow_open_access says so: the chart's default host, 0.0.0.0, is the
cluster network. The config loader refuses the same tree (cluster/config.py).
*/}}
{{- define "tierserve.checkAccess" -}}
{{- $router := .Values.config.router -}}
{{- $keyed := false -}}
{{- range (.Values.config.tenants | default list) -}}
{{- if or .api_keys .api_keys_file .api_keys_env -}}{{- $keyed = true -}}{{- end -}}
{{- end -}}
{{- $host := toString $router.host -}}
{{- $loopback := or (eq $host "localhost") (eq $host "::1") (hasPrefix "127." $host) -}}
{{- if and (not $keyed) (not $loopback) (not $router.allow_open_access) -}}
{{- fail (printf "config.router.host %s with no API key in config.tenants would serve anyone on the network: give a tenant api_keys, api_keys_file or api_keys_env (e.g. from a Secret through extraEnv), or set config.router.allow_open_access=true to serve without keys" $host) -}}
{{- end -}}
{{- end -}}
