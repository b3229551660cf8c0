"""What ``tierserve simulate --tune-peers`` tries for each peer: its documented step flags.

Each peer is swept over the step budget its users tune (256 to 8,192 tokens:
``max_num_batched_tokens`` for vLLM and the vLLM engines behind Dynamo,
``chunked_prefill_size`` for SGLang), vLLM also with ``long_prefill_token_threshold`` at
its documented default when chunked prefills overlap (4 % of ``max_model_len``: 327
tokens for Llama-3-8B's 8,192), and Dynamo also with its router queue
(``router_queue_threshold``, 2.0 in its configuration reference). The peer's defaults
come first, so that on a tie the defaults are kept. tierserve is never tuned.
"""

from __future__ import annotations

from scheduler.policy_spec import PolicySpec

STEP_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_BUDGET = 8192
# vLLM: long_prefill_token_threshold = int(0.04 * max_model_len) when
# max_num_partial_prefills > 1 (SchedulerConfig); Llama-3-8B's max_model_len is 8,192.
LONG_PREFILL_THRESHOLD = int(0.04 * 8192)
DYNAMO_ROUTER_QUEUE = 2.0

_VLLM = ("vllm-fcfs", "vllm-priority")
_SGLANG = ("sglang-lpm", "sglang-fcfs")
_DYNAMO = ("dynamo-priority",)


def _budgets() -> list[int]:
    return [DEFAULT_BUDGET, *(b for b in STEP_BUDGETS if b != DEFAULT_BUDGET)]


def peer_grid(name: str) -> list[PolicySpec]:
    """The settings tried for peer ``name`` (its defaults first); [] for tierserve."""
    if name in _VLLM:
        out = [PolicySpec(name, (("max_num_batched_tokens", str(b)),)) for b in _budgets()]
        out += [PolicySpec(name, (("max_num_batched_tokens", str(b)),
                                  ("long_prefill_token_threshold", str(LONG_PREFILL_THRESHOLD))))
                for b in _budgets() if b > LONG_PREFILL_THRESHOLD * 2]
        return out
    if name in _SGLANG:
        return [PolicySpec(name, (("chunked_prefill_size", str(b)),)) for b in _budgets()]
    if name in _DYNAMO:
        out = [PolicySpec(name, (("max_num_batched_tokens", str(b)),)) for b in _budgets()]
        out += [PolicySpec(name, (("max_num_batched_tokens", str(b)),
                                  ("router_queue_threshold", str(DYNAMO_ROUTER_QUEUE))))
                for b in _budgets()]
        return out
    return []


__all__ = ["STEP_BUDGETS", "peer_grid"]
