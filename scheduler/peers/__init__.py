"""Peer policies: public schedulers reproduced in the same decision interface.

Each class reproduces the documented behaviour of one open-source scheduler, cited in its
module's docstring from the source it was read from, so the simulator can compare them
with :class:`scheduler.policy.TierservePolicy` on the same cluster, cost model and trace.
All run disaggregated (prefill and decode pools) like tierserve, with a prefix cache on
every prefill worker; only the decisions differ. None of them rejects at admission. Each
takes the flags its users tune as settings (``vllm-priority:max_num_batched_tokens=2048``,
:mod:`scheduler.policy_spec`), with the system's defaults.
"""

from __future__ import annotations

from scheduler.peers.dynamo import DynamoPriorityPolicy, DynamoSettings
from scheduler.peers.sglang import SglangFcfsPolicy, SglangLpmPolicy, SglangSettings
from scheduler.peers.vllm import VllmFcfsPolicy, VllmPriorityPolicy, VllmSettings

__all__ = ["DynamoPriorityPolicy", "DynamoSettings", "SglangFcfsPolicy", "SglangLpmPolicy",
           "SglangSettings", "VllmFcfsPolicy", "VllmPriorityPolicy", "VllmSettings"]
