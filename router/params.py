"""Every request parameter of vLLM's OpenAI-compatible completions and chat endpoints (and
OpenAI's own), and what tierserve does with it: honour it, accept only its neutral value,
take it as information, or refuse it with a 400 that names it.

A silently ignored parameter is worse than a refused one (a benchmark with ``ignore_eos``
ignored measures something else than its user thinks), so nothing here is accepted and
dropped: :func:`check_params` runs on the raw JSON body before the request model parses
it, and every name below with a value other than its neutral one either has an effect or is
refused. Names that are in neither API stay ignored, as vLLM and OpenAI ignore them.

The list follows vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` (its current
protocol modules, plus the ``guided_*`` and ``best_of`` of the 0.x releases that clients
still send), and the OpenAI API reference for the fields vLLM leaves out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from router.protocol import ApiError


class Support(enum.Enum):
    HONOURED = "honoured"  # implemented: it changes the output as in vLLM
    NEUTRAL_ONLY = "neutral_only"  # accepted at its neutral value; anything else is a 400
    INFORMATIONAL = "informational"  # metadata about the caller: recorded nowhere, no effect
    REFUSED = "refused"  # any value but null (or its neutral one) is a 400


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    support: Support
    endpoints: frozenset[str]  # "chat", "completions"
    # Values that mean "not used" (absent and null always do).
    neutral: tuple[Any, ...] = ()
    why: str = ""


BOTH = frozenset({"chat", "completions"})
CHAT = frozenset({"chat"})
COMPLETIONS = frozenset({"completions"})

H, N, INFO, R = Support.HONOURED, Support.NEUTRAL_ONLY, Support.INFORMATIONAL, Support.REFUSED

PARAMS: tuple[Param, ...] = (
    # -- OpenAI's fields ------------------------------------------------------------------
    Param("model", H, BOTH),
    Param("messages", H, CHAT),
    Param("prompt", H, COMPLETIONS),
    Param("max_tokens", H, BOTH),
    Param("max_completion_tokens", H, CHAT),
    Param("temperature", H, BOTH),
    Param("top_p", H, BOTH),
    Param("n", H, BOTH),
    Param("best_of", H, COMPLETIONS),
    Param("stream", H, BOTH),
    Param("stream_options", H, BOTH),
    Param("stop", H, BOTH),
    Param("seed", H, BOTH),
    Param("presence_penalty", H, BOTH),
    Param("frequency_penalty", H, BOTH),
    Param("logit_bias", H, BOTH),
    Param("logprobs", H, BOTH),
    Param("top_logprobs", H, CHAT),
    Param("echo", H, BOTH),
    Param("response_format", H, BOTH),
    Param("tools", H, CHAT),
    Param("tool_choice", H, CHAT),
    Param("parallel_tool_calls", H, CHAT),
    Param("user", INFO, BOTH),
    Param("metadata", INFO, CHAT),
    Param("safety_identifier", INFO, CHAT),
    Param("prompt_cache_key", INFO, CHAT, why="the prefix cache needs no key: it hashes tokens"),
    Param("suffix", R, COMPLETIONS, why="no fill-in-the-middle format is configured"),
    Param("functions", R, CHAT, why="deprecated by OpenAI; send tools"),
    Param("function_call", R, CHAT, why="deprecated by OpenAI; send tool_choice"),
    Param("audio", R, CHAT, why="text models only"),
    Param("modalities", N, CHAT, neutral=(["text"],), why="text models only"),
    Param("prediction", R, CHAT, why="no speculative decoding"),
    Param("web_search_options", R, CHAT, why="no web search"),
    Param("store", N, CHAT, neutral=(False,), why="completions are not stored"),
    Param("service_tier", N, CHAT, neutral=("auto", "default"),
          why="tiers come from the API key's tenant or `priority`"),
    Param("verbosity", R, CHAT, why="not a reasoning model"),
    Param("reasoning_effort", R, CHAT, why="no reasoning parser is configured"),
    # -- vLLM's extra sampling parameters ------------------------------------------------
    Param("use_beam_search", N, BOTH, neutral=(False,), why="beam search is not implemented"),
    Param("top_k", H, BOTH),
    Param("min_p", H, BOTH),
    Param("repetition_penalty", H, BOTH),
    Param("length_penalty", N, BOTH, neutral=(1.0, 1), why="only used by beam search"),
    Param("stop_token_ids", H, BOTH),
    Param("include_stop_str_in_output", H, BOTH),
    Param("ignore_eos", H, BOTH),
    Param("min_tokens", H, BOTH),
    Param("skip_special_tokens", H, BOTH),
    Param("spaces_between_special_tokens", N, BOTH, neutral=(True,),
          why="the tokenizers' decode has no such option"),
    Param("truncate_prompt_tokens", H, BOTH),
    Param("truncation_side", H, BOTH),
    Param("allowed_token_ids", H, BOTH),
    Param("prompt_logprobs", H, BOTH),
    Param("bad_words", N, BOTH, neutral=([],), why="not implemented; use logit_bias"),
    Param("logprob_token_ids", R, BOTH, why="not implemented; use logprobs"),
    Param("watermarking", N, BOTH, neutral=(False,), why="not implemented"),
    # -- vLLM's extra parameters ---------------------------------------------------------
    Param("add_special_tokens", H, BOTH),
    Param("add_generation_prompt", H, CHAT),
    Param("continue_final_message", H, CHAT),
    Param("documents", H, CHAT),
    Param("chat_template_kwargs", H, CHAT),
    Param("chat_template", R, CHAT,
          why="a template from the request runs code on the server; the checkpoint's is used"),
    Param("media_io_kwargs", N, CHAT, neutral=({},), why="text models only"),
    Param("mm_processor_kwargs", N, CHAT, neutral=({},), why="text models only"),
    Param("include_reasoning", H, CHAT, why="no reasoning parser: there is none to split"),
    Param("thinking_token_budget", R, BOTH, why="not a reasoning model"),
    Param("structured_outputs", H, BOTH),
    Param("guided_json", H, BOTH),
    Param("guided_regex", H, BOTH),
    Param("guided_choice", H, BOTH),
    Param("guided_grammar", H, BOTH),
    Param("guided_decoding_backend", N, BOTH, neutral=("auto", "guidance", "llguidance"),
          why="the grammar backend is llguidance"),
    Param("guided_whitespace_pattern", R, BOTH, why="JSON output has no free whitespace"),
    Param("priority", H, BOTH),
    Param("request_id", H, BOTH),
    Param("session_id", INFO, BOTH),
    Param("return_tokens_as_token_ids", H, BOTH),
    Param("return_token_ids", H, BOTH),
    Param("return_token_offsets", N, BOTH, neutral=(False,), why="render endpoints only"),
    Param("return_mm_kwargs", N, BOTH, neutral=(True,), why="render endpoints only"),
    Param("mm_payload", N, BOTH, neutral=("tensors",), why="render endpoints only"),
    Param("return_prompt_text", H, CHAT),
    Param("routed_experts_prompt_start", N, BOTH, neutral=(0,), why="not a mixture of experts"),
    Param("prompt_embeds", R, COMPLETIONS, why="prompts are text or token ids"),
    Param("cache_salt", R, BOTH, why="the prefix cache is not salted per request"),
    Param("kv_transfer_params", R, BOTH, why="KV transfer is the cluster's own"),
    Param("ec_transfer_params", R, BOTH, why="no encoder cache"),
    Param("vllm_xargs", R, BOTH, why="no extensions read them"),
    Param("repetition_detection", R, BOTH, why="not implemented"),
    Param("stream_interval", N, BOTH, neutral=(1,), why="every token is streamed as it comes"),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}


def check_params(data: dict[str, Any], endpoint: str) -> None:
    """Refuse (400, naming it) a parameter that is set but neither honoured here nor at its
    neutral value, or that belongs to the other endpoint."""
    for name, value in data.items():
        p = BY_NAME.get(name)
        if p is None or value is None:
            continue
        if endpoint not in p.endpoints:
            other = "/v1/chat/completions" if "chat" in p.endpoints else "/v1/completions"
            raise ApiError(400, f"{name}: not a parameter of this endpoint (it is one of "
                           f"{other})", param=name, code="unsupported_parameter")
        if p.support is Support.REFUSED or (
                p.support is Support.NEUTRAL_ONLY and value not in p.neutral):
            shown = "" if p.support is Support.REFUSED else (
                f" (only {', '.join(repr(v) for v in p.neutral)} is accepted)")
            raise ApiError(400, f"{name}: not supported{shown}: {p.why}", param=name,
                           code="unsupported_parameter")
