"""Where each worker runs: node, device and NVLink domain (DESIGN §6).

Data flow: a worker calls :func:`detect_location` once at start. On a GPU node the
device's NVLink domain comes from NVML (``pynvml`` when importable) or from parsing
``nvidia-smi topo -m``; elsewhere (and as the fallback) from its Ray node's label
``tierserve.io/nvlink-domain`` (set by the Helm chart), else from the configuration's
declared :class:`~cluster.config.WorkerPlacement`. The node name likewise comes from the
label ``tierserve.io/k8s-node`` before the declared one (see
``cluster.worker_runtime.locate``). The global scheduler compares two
locations with :func:`topology_class` to prefer decode workers in the prefill worker's
domain and to count transfers by class.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from scheduler.topology import TopologyClass, WorkerInfo, WorkerRole, classify

__all__ = [
    "LABEL_DOMAIN",
    "LABEL_K8S_NODE",
    "LABEL_ROLE",
    "TopologyClass",
    "WorkerLocation",
    "detect_location",
    "domain_resource",
    "label_value",
    "role_resource",
    "nvlink_groups_from_topo_matrix",
    "topology_class",
]


# Ray node labels the Helm chart puts on each worker node (``ray start --labels``).
LABEL_DOMAIN = "tierserve.io/nvlink-domain"
LABEL_ROLE = "tierserve.io/role"
LABEL_K8S_NODE = "tierserve.io/k8s-node"


def domain_resource(domain: str) -> str:
    """The Ray custom resource of NVLink domain ``domain`` (the chart's name for it):
    ``nvl-a`` -> ``tierserve_domain_nvl_a``."""
    return "tierserve_domain_" + re.sub(r"[^A-Za-z0-9_]", "_", domain)


def role_resource(role: str) -> str:
    """The Ray custom resource of a worker group's nodes: ``tierserve_prefill``."""
    return f"tierserve_{role}"


def label_value(labels: object, key: str) -> str | None:
    """One node label's value, or None when absent or empty (Ray gives ``str`` values;
    a list is read as its first item)."""
    if not isinstance(labels, dict):
        return None
    v = labels.get(key)
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    if v is None:
        return None
    text = str(v).strip()
    # An unexpanded $(VAR) (the pod's env var missing) is not a value.
    return text if text and not text.startswith("$(") else None


@dataclass(frozen=True, slots=True)
class WorkerLocation:
    node: str
    device: str  # "cpu", "cuda:0", ...
    nvlink_domain: str

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "device": self.device, "nvlink_domain": self.nvlink_domain}

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> WorkerLocation:
        return cls(node=str(d["node"]), device=str(d["device"]), nvlink_domain=str(d["nvlink_domain"]))

    def to_worker_info(self, worker_id: str, role: WorkerRole, num_kv_blocks: int) -> WorkerInfo:
        """The scheduler kernel's view of this worker (same classes, same values)."""
        return WorkerInfo(worker_id=worker_id, role=role, node=self.node, device=self.device,
                          domain=self.nvlink_domain, num_kv_blocks=num_kv_blocks)


def topology_class(a: WorkerLocation, b: WorkerLocation) -> TopologyClass:
    return classify(a.node, a.device, a.nvlink_domain, b.node, b.device, b.nvlink_domain)


def nvlink_groups_from_topo_matrix(text: str) -> dict[int, int]:
    """Parse ``nvidia-smi topo -m``: GPU index -> domain id (connected by NV# links).

    Domains are the connected components of the NVLink graph; a GPU with no NVLink
    is a domain of its own.
    """
    rows: dict[int, list[str]] = {}
    header: list[str] = []
    for line in text.splitlines():
        cells = line.split()
        if not cells:
            continue
        if not header and cells[0].startswith("GPU0"):
            header = [c for c in cells if c.startswith("GPU")]
            continue
        if header and cells[0].startswith("GPU") and cells[0][3:].isdigit():
            rows[int(cells[0][3:])] = cells[1 : 1 + len(header)]
    parent = {g: g for g in rows}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for g, cells in rows.items():
        for j, cell in enumerate(cells):
            if cell.startswith("NV") and j in parent:
                parent[find(g)] = find(j)
    roots = sorted({find(g) for g in rows})
    return {g: roots.index(find(g)) for g in rows}


def _nvlink_domain_nvml(index: int) -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        peers = {index}
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for other in range(count):
            if other == index:
                continue
            h2 = pynvml.nvmlDeviceGetHandleByIndex(other)
            status = pynvml.nvmlDeviceGetP2PStatus(handle, h2, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status == pynvml.NVML_P2P_STATUS_OK:
                peers.add(other)
        return f"nvl{min(peers)}"
    except Exception:  # NVML present but unusable (driver mismatch, container limits)
        return None


def _nvlink_domain_smi(index: int) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    groups = nvlink_groups_from_topo_matrix(out.stdout)
    return f"nvl{groups[index]}" if index in groups else None


def detect_location(
    node: str,
    device: str,
    declared_domain: str | None,
) -> WorkerLocation:
    """This worker's location: NVML / nvidia-smi on CUDA, else the declared domain.

    ``node`` is the Ray node id (or the declared node name on a test cluster).
    """
    domain: str | None = None
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        domain = _nvlink_domain_nvml(index) or _nvlink_domain_smi(index)
        if domain is not None:
            domain = f"{node}/{domain}"
    if domain is None:
        domain = declared_domain or f"{node}/host"
    return WorkerLocation(node=node, device=device, nvlink_domain=domain)
