"""The Helm chart (helm/kvstore) and the vLLM example, rendered by a real Helm engine.

Needs `pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0`:
- helm-python-sdk bundles Helm's Go library (Helm v4) and renders charts offline, with the same
  values.schema.json validation and template functions as `helm template`;
- kubernetes-validate bundles the Kubernetes JSON schemas; manifests are checked strictly
  (unknown fields are errors) against the oldest Kubernetes the chart supports and the newest known.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kvstore"
EXAMPLE = ROOT / "helm" / "examples" / "vllm-deployment.yaml"
KUBE_VERSIONS = ["1.27", "1.37"]  # Chart.yaml: kubeVersion >=1.27
SOCKET_DIR = "/run/kvstore"
SOCKET = "/run/kvstore/kvstore.sock"
HEALTH = ["kvstore", "health", "--socket", SOCKET]
MiB = 1 << 20


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values=None):
    """Render like `helm template kvstore helm/kvstore -n kvstore`; returns (manifests, NOTES.txt)."""
    out = chart.render(values or {}, name="kvstore", namespace="kvstore")
    docs, notes = [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
        else:
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    validate(docs)
    return docs, notes


def validate(docs):
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD kind: not in the Kubernetes schemas; test_metrics_service_monitor checks it
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def only(docs, kind):
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def kinds(docs):
    return sorted(doc["kind"] for doc in docs)


def pod_spec(docs):
    return only(docs, "DaemonSet")["spec"]["template"]["spec"]


def daemon(docs):
    (container,) = [c for c in pod_spec(docs)["containers"] if c["name"] == "kvstore"]
    return container


def env(container):
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def volumes(spec):
    return {volume["name"]: volume for volume in spec["volumes"]}


def mounts(container):
    return {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}


def volume_at(spec, container, path):
    """The volume mounted at `path` in `container`."""
    return volumes(spec)[mounts(container)[path]["name"]]


def host_paths(spec, container):
    """Node path of each hostPath volume mounted in `container`, by mount path."""
    return {
        path: volumes(spec)[mount["name"]]["hostPath"]["path"]
        for path, mount in mounts(container).items()
        if "hostPath" in volumes(spec)[mount["name"]]
    }


def test_default_values(chart):
    docs, _ = render(chart)
    assert kinds(docs) == ["DaemonSet"]
    spec = pod_spec(docs)
    container = daemon(docs)
    variables = env(container)

    # The socket lives in a node directory mounted at the same path.
    assert volume_at(spec, container, SOCKET_DIR)["hostPath"] == {
        "path": SOCKET_DIR,
        "type": "DirectoryOrCreate",
    }
    assert variables["KVSTORE_SOCKET"] == SOCKET
    assert variables["KVSTORE_SOCKET_MODE"] == "0660"
    # Engines pass their memory as memfds over <socket>.cred, next to the socket: the node's /dev/shm
    # is not mounted, and the socket directory is the only node path the daemon sees.
    assert "/dev/shm" not in mounts(container)
    assert host_paths(spec, container) == {SOCKET_DIR: SOCKET_DIR}

    # The pool: 4GiB in a memory-backed emptyDir; memory = pool + 1GiB overhead, request = limit.
    assert variables["KVSTORE_POOL_SIZE"] == "4GiB"
    pool_dir = variables["KVSTORE_POOL_PATH"].rsplit("/", 1)[0]
    assert volume_at(spec, container, pool_dir)["emptyDir"] == {"medium": "Memory", "sizeLimit": "4352Mi"}
    assert container["resources"]["requests"]["memory"] == "5120Mi"
    assert container["resources"]["limits"]["memory"] == "5120Mi"

    # gRPC health through `kvstore health` on the unix socket.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == HEALTH

    # No device IPC, so no host IPC namespace.
    assert "hostIPC" not in spec
    assert not any(name.startswith(("NVIDIA_", "ASCEND_")) for name in variables)

    # Least privilege: non-root, read-only root filesystem, no capabilities, no API token.
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["automountServiceAccountToken"] is False
    # Only the init container that hands the socket directory to the daemon's user runs as root.
    (init,) = spec["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["securityContext"]["runAsUser"] == 0
    init_mount = init["volumeMounts"][0]
    assert volumes(spec)[init_mount["name"]]["hostPath"]["path"] == SOCKET_DIR
    assert f"chown 10001:10001 {init_mount['mountPath']}" in init["command"][-1]

    # Metrics on, scraped through pod annotations.
    assert variables["KVSTORE_METRICS_PORT"] == "9400"
    annotations = only(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9400"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert variables["KVSTORE_LOG_LEVEL"] == "INFO"


@pytest.mark.parametrize(
    ("size", "overhead", "pool_bytes", "overhead_bytes"),
    [
        ("1.5GiB", "1GiB", 1.5 * 2**30, 2**30),
        ("10GB", "512MiB", 10 * 10**9, 512 * MiB),
        (1073741824, "0", 2**30, 0),
        ("2TiB", "2GiB", 2 * 2**40, 2 * 2**30),
        ("700MB", 268435456, 700 * 10**6, 256 * MiB),
    ],
)
def test_memory_follows_pool_size(chart, size, overhead, pool_bytes, overhead_bytes):
    docs, _ = render(chart, {"pool": {"size": size}, "memoryOverhead": overhead, "logLevel": "DEBUG"})
    container = daemon(docs)
    expected = f"{math.ceil((pool_bytes + overhead_bytes) / MiB)}Mi"
    assert container["resources"]["requests"]["memory"] == expected
    assert container["resources"]["limits"]["memory"] == expected
    headroom = 256 * MiB
    pool = volumes(pod_spec(docs))["pool"]["emptyDir"]
    assert pool["sizeLimit"] == f"{math.ceil((pool_bytes + headroom) / MiB)}Mi"
    assert env(container)["KVSTORE_POOL_SIZE"] == str(size)
    assert env(container)["KVSTORE_LOG_LEVEL"] == "DEBUG"


def test_pool_on_node_shm(chart):
    docs, _ = render(chart, {"pool": {"volume": "hostShm", "size": "8GiB"}})
    spec = pod_spec(docs)
    container = daemon(docs)
    assert env(container)["KVSTORE_POOL_PATH"] == "/dev/shm/kvstore-pool"
    # The pool dir is the node's /dev/shm: the one /dev/shm mount, for the pool only.
    assert volume_at(spec, container, "/dev/shm")["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    assert host_paths(spec, container) == {SOCKET_DIR: SOCKET_DIR, "/dev/shm": "/dev/shm"}
    assert not any("emptyDir" in volume and volume["emptyDir"].get("medium") for volume in spec["volumes"])
    assert container["resources"]["limits"]["memory"] == "9216Mi"


def test_nvidia(chart):
    docs, notes = render(chart, {"accelerator": "nvidia", "runtimeClassName": "nvidia"})
    spec = pod_spec(docs)
    container = daemon(docs)
    assert spec["hostIPC"] is True
    assert spec["runtimeClassName"] == "nvidia"
    variables = env(container)
    assert variables["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert variables["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    # The daemon shares the node's GPUs with vLLM pods: it must not take any from the device plugin.
    assert set(container["resources"]["limits"]) == {"memory"}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert "privileged" not in container["securityContext"]
    assert "hostIPC: true" in notes
    # hostIPC is for device IPC only; engine memory still comes as memfds, not through /dev/shm.
    assert "/dev/shm" not in mounts(container)


def test_ascend(chart):
    docs, _ = render(chart, {"accelerator": "ascend", "ascend": {"devices": [0, 3]}})
    spec = pod_spec(docs)
    container = daemon(docs)
    assert spec["hostIPC"] is True
    for device in [
        "/dev/davinci0",
        "/dev/davinci3",
        "/dev/davinci_manager",
        "/dev/devmm_svm",
        "/dev/hisi_hdc",
    ]:
        assert volume_at(spec, container, device)["hostPath"] == {"path": device, "type": "CharDevice"}
    assert "/dev/davinci1" not in mounts(container)
    driver = "/usr/local/Ascend/driver"
    assert mounts(container)[driver]["readOnly"] is True
    assert volume_at(spec, container, driver)["hostPath"] == {"path": driver, "type": "Directory"}
    variables = env(container)
    assert variables["ASCEND_VISIBLE_DEVICES"] == "0,3"
    assert f"{driver}/lib64" in variables["LD_LIBRARY_PATH"].split(":")
    # hostPath device files need a privileged container unless the Ascend runtime injects them;
    # Kubernetes refuses privileged together with allowPrivilegeEscalation: false.
    assert container["securityContext"]["privileged"] is True
    assert "allowPrivilegeEscalation" not in container["securityContext"]
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_ascend_with_ascend_runtime_is_not_privileged(chart):
    values = {"accelerator": "ascend", "ascend": {"privileged": False}, "runtimeClassName": "ascend"}
    docs, _ = render(chart, values)
    container = daemon(docs)
    assert "privileged" not in container["securityContext"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert env(container)["ASCEND_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert pod_spec(docs)["runtimeClassName"] == "ascend"


def test_metrics_service_monitor(chart):
    values = {"metrics": {"port": 9500, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    docs, _ = render(chart, values)
    assert kinds(docs) == ["DaemonSet", "Service", "ServiceMonitor"]
    pod_labels = only(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    service = only(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 9500
    assert {"name": "metrics", "containerPort": 9500, "protocol": "TCP"} in daemon(docs)["ports"]
    assert env(daemon(docs))["KVSTORE_METRICS_PORT"] == "9500"

    monitor = only(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/metrics"


def test_metrics_service_without_monitor(chart):
    docs, _ = render(chart, {"metrics": {"service": {"enabled": True}}})
    assert kinds(docs) == ["DaemonSet", "Service"]


def test_metrics_off(chart):
    docs, _ = render(chart, {"metrics": {"port": 0}})
    container = daemon(docs)
    assert env(container)["KVSTORE_METRICS_PORT"] == "0"
    assert "ports" not in container
    assert "annotations" not in only(docs, "DaemonSet")["spec"]["template"]["metadata"]


def test_tcp_with_mutual_tls(chart):
    values = {"tcp": {"enabled": True, "tls": {"secretName": "kvstore-tls", "clientCA": True}}}
    docs, _ = render(chart, values)
    spec = pod_spec(docs)
    container = daemon(docs)
    variables = env(container)
    assert variables["KVSTORE_TCP"] == "0.0.0.0:50051"
    assert "KVSTORE_INSECURE" not in variables
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in container["ports"]
    tls_dir = "/etc/kvstore/tls"
    assert mounts(container)[tls_dir]["readOnly"] is True
    assert volume_at(spec, container, tls_dir)["secret"]["secretName"] == "kvstore-tls"
    assert variables["KVSTORE_TLS_CERT"] == f"{tls_dir}/tls.crt"
    assert variables["KVSTORE_TLS_KEY"] == f"{tls_dir}/tls.key"
    assert variables["KVSTORE_TLS_CLIENT_CA"] == f"{tls_dir}/ca.crt"
    # The unix socket stays the health-checked endpoint.
    assert container["readinessProbe"]["exec"]["command"] == HEALTH


def test_tcp_insecure(chart):
    docs, _ = render(chart, {"tcp": {"enabled": True, "insecure": True, "port": 7000}})
    variables = env(daemon(docs))
    assert variables["KVSTORE_TCP"] == "0.0.0.0:7000"
    assert variables["KVSTORE_INSECURE"] == "true"
    assert not any(name.startswith("KVSTORE_TLS") for name in variables)
    assert "tls" not in volumes(pod_spec(docs))


def test_settings_and_socket_access(chart):
    values = {
        "settings": {"copy_threads": 4, "verify_loads": 0.25, "fresh": True, "max_request_bytes": "128MiB",
                     "tenants": {"team-a": {"uids": [1000]}}, "admin_uids": [0]},
        "socket": {"dir": "/var/run/kv", "name": "d.sock", "group": 2000, "allowedUids": [0, 1000]},
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
    }
    docs, _ = render(chart, values)
    spec = pod_spec(docs)
    container = daemon(docs)
    variables = env(container)
    assert variables["KVSTORE_COPY_THREADS"] == "4"
    assert variables["KVSTORE_VERIFY_LOADS"] == "0.25"
    assert variables["KVSTORE_FRESH"] == "true"
    assert variables["KVSTORE_MAX_REQUEST_BYTES"] == "128MiB"
    assert variables["KVSTORE_SOCKET"] == "/var/run/kv/d.sock"
    assert variables["KVSTORE_SOCKET_GROUP"] == "2000"
    assert json.loads(variables["KVSTORE_ALLOWED_UIDS"]) == [0, 1000]
    assert json.loads(variables["KVSTORE_TENANTS"]) == {"team-a": {"uids": [1000]}}
    assert json.loads(variables["KVSTORE_ADMIN_UIDS"]) == [0]
    assert variables["EXTRA"] == "1"
    assert volume_at(spec, container, "/var/run/kv")["hostPath"]["path"] == "/var/run/kv"
    assert container["livenessProbe"]["exec"]["command"] == [
        "kvstore",
        "health",
        "--socket",
        "/var/run/kv/d.sock",
    ]


def test_scheduling_values(chart):
    values = {
        "nodeSelector": {"kvstore": "enabled"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "system-node-critical",
        "image": {"repository": "registry.example.com/kvstore", "tag": "1.2.3"},
        "socket": {"fixPermissions": False},
    }
    docs, _ = render(chart, values)
    spec = pod_spec(docs)
    assert spec["nodeSelector"] == {"kvstore": "enabled"}
    assert spec["tolerations"] == values["tolerations"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert daemon(docs)["image"] == "registry.example.com/kvstore:1.2.3"
    assert "initContainers" not in spec


BAD_VALUES = {
    "negative pool size": (
        {"pool": {"size": "-4GiB"}},
        ["at '/pool/size': '-4GiB' does not match pattern '^[0-9]+", "(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?$'"],
    ),
    "pool size with a space": (
        {"pool": {"size": "4 GB"}},
        ["at '/pool/size': '4 GB' does not match pattern"],
    ),
    "pool size unknown unit": ({"pool": {"size": "4G"}}, ["at '/pool/size': '4G' does not match pattern"]),
    "zero pool size": (
        {"pool": {"size": "0GiB"}},
        ["at '/pool/size'", "'0GiB' does not match pattern '[1-9]'"],
    ),
    "zero pool bytes": ({"pool": {"size": 0}}, ["at '/pool/size': minimum: got 0, want 1"]),
    "missing socket dir": ({"socket": {"dir": None}}, ["at '/socket': missing property 'dir'"]),
    "relative socket dir": (
        {"socket": {"dir": "run/kvstore"}},
        ["at '/socket/dir': 'run/kvstore' does not match"],
    ),
    "socket mode as a number": ({"socket": {"mode": 432}}, ["at '/socket/mode': got number, want string"]),
    "unknown accelerator": (
        {"accelerator": "amd"},
        ["at '/accelerator': value must be one of 'none', 'nvidia', 'ascend'"],
    ),
    "unknown log level": ({"logLevel": "TRACE"}, ["at '/logLevel': value must be one of"]),
    "chart-managed setting": (
        {"settings": {"pool_size": "1GiB"}},
        ["at '/settings': additional properties 'pool_size' not allowed"],
    ),
    "misspelled value": ({"poolSize": "1GiB"}, ["additional properties 'poolSize' not allowed"]),
    "tcp without tls": (
        {"tcp": {"enabled": True}},
        ["tcp.enabled=true needs TLS: set tcp.tls.secretName", "or set tcp.insecure=true"],
    ),
    "client CA without a secret": (
        {"tcp": {"enabled": True, "insecure": True, "tls": {"clientCA": True}}},
        ["tcp.tls.clientCA=true needs tcp.tls.secretName"],
    ),
    "tcp on the metrics port": (
        {"tcp": {"enabled": True, "insecure": True, "port": 9400}},
        ["tcp.port and metrics.port are both 9400"],
    ),
    "service monitor without metrics": (
        {"metrics": {"port": 0, "serviceMonitor": {"enabled": True}}},
        ["metrics.serviceMonitor.enabled need metrics.port > 0"],
    ),
    "ascend without devices": (
        {"accelerator": "ascend", "ascend": {"devices": []}},
        ["needs ascend.devices"],
    ),
}


@pytest.mark.parametrize(("values", "messages"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_values_fail_with_a_clear_message(chart, values, messages):
    with pytest.raises(helm.HelmError) as failure:
        chart.render(values, name="kvstore", namespace="kvstore")
    for message in messages:
        assert message in str(failure.value)


def kv_transfer_config(text):
    return json.loads(re.search(r"--kv-transfer-config '(.*)'", text).group(1))


def test_notes_show_the_vllm_config(chart):
    _, notes = render(chart, {"clients": {"tenantSalt": "team-a"}})
    assert kv_transfer_config(notes) == {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_client.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": SOCKET, "tenant_salt": "team-a"},
    }
    assert "kubectl -n kvstore exec ds/kvstore -- kvstore stats" in notes
    # vLLM pods mount the socket directory, which holds the handshake socket too; not /dev/shm.
    assert f"{SOCKET}.cred" in notes
    assert "/dev/shm" not in notes
    _, notes = render(chart)
    assert "tenant_salt" not in kv_transfer_config(notes)["kv_connector_extra_config"]


def test_chart_lints_clean():
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_vllm_example_uses_the_daemon_socket(chart):
    docs = [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc]
    validate(docs)
    deployment = only(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVStoreConnector"
    assert config["kv_connector_module_path"] == "kvstore_client.vllm"
    assert config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"]["tenant_salt"]

    # The socket the example connects to is the one the chart's daemon listens on, from the same node dir.
    chart_docs, _ = render(chart, {"accelerator": "nvidia"})
    daemon_socket = env(daemon(chart_docs))["KVSTORE_SOCKET"]
    assert config["kv_connector_extra_config"]["socket"] == daemon_socket
    socket_dir = daemon_socket.rsplit("/", 1)[0]
    assert volume_at(spec, container, socket_dir)["hostPath"]["path"] == socket_dir
    # Its memory goes to the daemon as memfds over <socket>.cred in that directory: no /dev/shm mount.
    assert host_paths(spec, container) == {socket_dir: socket_dir}
    assert not any(volume.get("hostPath", {}).get("path") == "/dev/shm" for volume in spec["volumes"])
    # CUDA IPC between the engine and the daemon needs one IPC namespace on both sides.
    assert spec["hostIPC"] is pod_spec(chart_docs)["hostIPC"] is True
    daemon_gid = pod_spec(chart_docs)["securityContext"]["runAsGroup"]
    assert daemon_gid in spec["securityContext"]["supplementalGroups"]
