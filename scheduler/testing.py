"""Small factories for tests of the kernel and of packages built on it (verify, cluster)."""

from __future__ import annotations

from scheduler.deadlines import LinearEstimate
from scheduler.request import Request, RequestState
from scheduler.topology import LinkCosts, TopologyClass, WorkerInfo, WorkerRole

EST = LinearEstimate(prefill_per_token_s=1e-4, decode_per_token_s=0.02)


def make_request(req_id: str = "r", tier: int = 0, arrival: float = 0.0, prompt: int = 100,
                 out: int = 10, state: RequestState = RequestState.QUEUED,
                 hashes: tuple[int, ...] = (), **kw: object) -> Request:
    r = Request(req_id=req_id, tier=tier, arrival_time=arrival, prompt_len=prompt,
                max_new_tokens=out, block_hashes=hashes, state=state)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def make_worker(wid: str, role: WorkerRole = WorkerRole.DECODE, node: str = "n0",
                domain: str = "d0", device: str | None = None, blocks: int = 100) -> WorkerInfo:
    return WorkerInfo(wid, role, node, device or f"cuda:{wid}", domain, blocks)


def make_costs() -> LinkCosts:
    bw = {TopologyClass.SAME_DEVICE: 1e12, TopologyClass.SAME_DOMAIN: 4e11,
          TopologyClass.SAME_NODE: 5e10, TopologyClass.CROSS_NODE: 2.5e10}
    lat = {c: 1e-5 for c in TopologyClass}
    return LinkCosts(bytes_per_block=2 * 1024 * 1024, bw=bw, latency=lat, host_bw=5e10)
