{{- define "kvstore.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvstore.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvstore.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvstore.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Socket path, the same on the node, in the daemon and in the engines. */}}
{{- define "kvstore.socketPath" -}}
{{- $dir := required "socket.dir is required: the node directory that holds the daemon's unix socket" .Values.socket.dir -}}
{{- printf "%s/%s" (trimSuffix "/" $dir) .Values.socket.name -}}
{{- end -}}

{{/* A size value ("4GiB", "1.5GB", or a number of bytes) as text. Helm reads numbers as floats. */}}
{{- define "kvstore.sizeString" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ printf "%.0f" (float64 .) }}{{- end -}}
{{- end -}}

{{/* A size value in bytes, as text (callers convert it with float64). */}}
{{- define "kvstore.bytes" -}}
{{- $s := include "kvstore.sizeString" . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $s -}}
{{- $unit := trimPrefix $num $s -}}
{{- $units := dict "" 1 "B" 1 "KB" 1e3 "MB" 1e6 "GB" 1e9 "TB" 1e12 "KiB" 1024 "MiB" 1048576 "GiB" 1073741824 "TiB" 1099511627776 -}}
{{- if or (not $num) (not (hasKey $units $unit)) -}}
{{- fail (printf "%q is not a size: use bytes with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)" $s) -}}
{{- end -}}
{{- mulf $num (get $units $unit) -}}
{{- end -}}

{{/* Bytes (text) as a Kubernetes quantity in MiB, rounded up. */}}
{{- define "kvstore.mebibytes" -}}
{{- printf "%.0fMi" (ceil (divf (float64 .) 1048576)) -}}
{{- end -}}

{{/* Memory request and limit of the daemon: pool + memoryOverhead (on huge pages, memoryOverhead: the pool's
pages are hugepages-2Mi). */}}
{{- define "kvstore.memory" -}}
{{- $pool := include "kvstore.bytes" .Values.pool.size | float64 -}}
{{- if lt $pool 1.0 -}}
{{- fail (printf "pool.size must be greater than zero (got %q)" (include "kvstore.sizeString" .Values.pool.size)) -}}
{{- end -}}
{{- $overhead := include "kvstore.bytes" .Values.memoryOverhead | float64 -}}
{{- include "kvstore.mebibytes" (ternary 0.0 $pool (eq .Values.pool.volume "hugePages") | addf $overhead) -}}
{{- end -}}

{{/* The pool's volume in bytes: pool + headroom. */}}
{{- define "kvstore.poolVolumeBytes" -}}
{{- addf (include "kvstore.bytes" .Values.pool.size | float64) (include "kvstore.bytes" .Values.pool.headroom | float64) -}}
{{- end -}}

{{/* sizeLimit of the memory-backed pool volume. */}}
{{- define "kvstore.poolVolumeSize" -}}
{{- include "kvstore.mebibytes" (include "kvstore.poolVolumeBytes" . | float64) -}}
{{- end -}}

{{/* hugepages-2Mi of the pool on huge pages: its volume in whole 2 MiB pages. */}}
{{- define "kvstore.hugePages" -}}
{{- printf "%.0fMi" (mulf 2 (ceil (divf (include "kvstore.poolVolumeBytes" . | float64) 2097152))) -}}
{{- end -}}

{{/* A daemon setting as an environment variable value. */}}
{{- define "kvstore.envValue" -}}
{{- if kindIs "string" . -}}{{ . }}
{{- else if kindIs "bool" . -}}{{ ternary "true" "false" . }}
{{- else if or (kindIs "slice" .) (kindIs "map" .) -}}{{ toJson . }}
{{- else if eq (float64 .) (floor .) -}}{{ printf "%.0f" (float64 .) }}
{{- else -}}{{ float64 . }}
{{- end -}}
{{- end -}}

{{/* Where the disk tier's volume is mounted, in the daemon and in the init container. */}}
{{- define "kvstore.diskMount" -}}/var/lib/kvstore/disk{{- end -}}

{{/* The disk tier's directory in its volume: one per node on a claim (all daemon pods mount the same
one), with $(NODE_NAME) expanded by Kubernetes from the container's env. */}}
{{- define "kvstore.diskSubdir" -}}
{{- ternary "kvstore-$(NODE_NAME)" "kvstore" (ne .Values.disk.existingClaim "") -}}
{{- end -}}

{{/* The disk tier's directory as the daemon sees it (KVSTORE_DISK_PATH). */}}
{{- define "kvstore.diskPath" -}}
{{- printf "%s/%s" (include "kvstore.diskMount" .) (include "kvstore.diskSubdir" .) -}}
{{- end -}}

{{- define "kvstore.metricsServiceEnabled" -}}
{{- if or .Values.metrics.service.enabled .Values.metrics.serviceMonitor.enabled -}}true{{- end -}}
{{- end -}}

{{/* Cross-field checks the schema cannot express. */}}
{{- define "kvstore.validate" -}}
{{- if and .Values.tcp.enabled (not .Values.tcp.tls.secretName) (not .Values.tcp.insecure) -}}
{{- fail "tcp.enabled=true needs TLS: set tcp.tls.secretName to a kubernetes.io/tls Secret (tls.crt, tls.key), or set tcp.insecure=true to accept plaintext TCP" -}}
{{- end -}}
{{- if and .Values.tcp.tls.clientCA (not .Values.tcp.tls.secretName) -}}
{{- fail "tcp.tls.clientCA=true needs tcp.tls.secretName: the Secret's ca.crt verifies client certificates" -}}
{{- end -}}
{{- if and (include "kvstore.metricsServiceEnabled" .) (eq (int .Values.metrics.port) 0) -}}
{{- fail "metrics.service.enabled and metrics.serviceMonitor.enabled need metrics.port > 0 (0 turns metrics off)" -}}
{{- end -}}
{{- if and .Values.tcp.enabled (eq (int .Values.tcp.port) (int .Values.metrics.port)) -}}
{{- fail (printf "tcp.port and metrics.port are both %d: use two different ports" (int .Values.tcp.port)) -}}
{{- end -}}
{{- if ne (include "kvstore.sizeString" .Values.disk.size) "" -}}
{{- if and (not .Values.disk.existingClaim) (not .Values.disk.hostPath) -}}
{{- fail "disk.size needs disk.hostPath (a node directory) or disk.existingClaim (a PersistentVolumeClaim) to keep the disk tier in" -}}
{{- end -}}
{{- $size := include "kvstore.bytes" .Values.disk.size | float64 -}}
{{- $segment := include "kvstore.bytes" (.Values.settings.disk_segment_size | default "256MiB") | float64 -}}
{{- if lt $size (mulf 2 $segment) -}}
{{- fail (printf "disk.size %s must hold at least two disk segments of %s (settings.disk_segment_size)" (include "kvstore.sizeString" .Values.disk.size) (include "kvstore.sizeString" (.Values.settings.disk_segment_size | default "256MiB"))) -}}
{{- end -}}
{{- end -}}
{{- if and (not .Values.remote.url) (or .Values.remote.passwordSecret.name .Values.remote.tlsCASecret.name .Values.remote.keySecret.name .Values.remote.encrypt) -}}
{{- fail "remote.passwordSecret, remote.tlsCASecret, remote.keySecret and remote.encrypt need remote.url (the Redis/Valkey store)" -}}
{{- end -}}
{{- if and .Values.remote.encrypt (not .Values.remote.keySecret.name) -}}
{{- fail "remote.encrypt needs remote.keySecret.name (the daemons' secret the payloads are encrypted with)" -}}
{{- end -}}
{{- if regexMatch "^[^:]+://[^/@]*:[^/]*@" .Values.remote.url -}}
{{- fail "remote.url must not carry a password (the URL is in the pod spec): put it in a Secret and set remote.passwordSecret.name" -}}
{{- end -}}
{{- if and .Values.remote.tlsCASecret.name (not (hasPrefix "rediss" .Values.remote.url)) -}}
{{- fail "remote.tlsCASecret verifies a TLS store: use a rediss:// or rediss+cluster:// remote.url" -}}
{{- end -}}
{{- if and (eq .Values.accelerator "ascend") (not .Values.ascend.devices) -}}
{{- fail "accelerator=ascend needs ascend.devices: the NPU indices of the node, e.g. [0, 1, 2, 3]" -}}
{{- end -}}
{{- end -}}
