"""The openai client over every feature of issue 14, against a live cluster (1 prefill and
1 decode worker, disaggregated, so the first tokens, logprobs and forks cross the KV
transfer): sampling parameters, n and best_of, logprobs (streamed too), echo, prompt lists,
cached tokens, structured output, tools, the side endpoints, a refused parameter.

The tiny llama's tokenizer is given a Hermes-style chat template that renders tools, so
forced tool calls (a grammar over the call's JSON) come back parsed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny-tools"
TOOLS_TEMPLATE = (
    "{% if tools %}<|bos|>system\nTools: {{ tools | tojson }}\nCall one as <tool_call>"
    '{"name": ..., "arguments": ...}</tool_call><|eos|>\n{% endif %}'
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from engine.testing import make_byte_tokenizer, make_tiny_checkpoint

    torch.set_num_threads(1)
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    tok = make_byte_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_path: Path) -> Iterator[object]:
    import ray

    from cluster.app import deploy, init_ray
    from cluster.config import load_config
    from cluster.testing import free_port

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cfg = load_config(overrides=[
        "pools.mode=disaggregated", f"model.path={tiny_path}", f"model.served_name={MODEL}",
        f"router.port={free_port()}", "model.dtype=float32", "pools.num_prefill=1",
        "pools.num_decode=1", "pools.num_cpus_per_worker=0.25", "pools.num_kv_blocks=128",
        "pools.prefill_chunk_size=32", "router.rpc_timeout_s=5"], environ={})
    init_ray(None, num_cpus=4)
    running = deploy(cfg)
    yield running
    running.shutdown()
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster: object):  # -> openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                         timeout=180)


MSGS = [{"role": "user", "content": "Say something."}]


def test_sampling_parameters_n_and_seeds(client) -> None:
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4,
             "ignore_eos": True}
    kw = dict(model=MODEL, messages=MSGS, max_tokens=10, temperature=0.9, seed=5, n=3,
              presence_penalty=0.2, frequency_penalty=0.1, extra_body=extra)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 30  # ignore_eos: every sequence ran to max_tokens
    # a bias that makes one byte certain, greedy
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                  logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "AAAAAA"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                  logit_bias={"66": 100}, extra_body={"stop_token_ids": [66]})
    # as in vLLM, the stop token is in the output unless it is a special token
    assert r.choices[0].text == "B" and r.choices[0].finish_reason == "stop"


def test_logprobs_echo_best_of_and_prompt_lists(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True,
                                  logprobs=2, temperature=0)
    lps = r.choices[0].logprobs
    assert r.choices[0].text.startswith("hello")
    assert lps.tokens[:5] == list("hello") and lps.token_logprobs[0] is None
    assert len(lps.tokens) == 5 + r.usage.completion_tokens
    r = client.completions.create(model=MODEL, prompt="pick", max_tokens=4, best_of=3, n=1,
                                  temperature=1.0, seed=2)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=3,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == 11


def test_cached_tokens_from_the_prefix_cache(client) -> None:
    prompt = "a long shared prefix " * 6  # 126 bytes: 7 full blocks
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 96


def test_streaming_n_and_logprobs(client) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, n=2, temperature=1.0, seed=3, stream=True,
        logprobs=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    tokens = {0: 0, 1: 0}
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs and ch.logprobs.content:
                tokens[ch.index] += len(ch.logprobs.content)
    assert tokens == {0: 6, 1: 6}
    assert chunks[-1].usage.completion_tokens == 12


def test_structured_output_validates(client) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=80, temperature=1.0, seed=1, n=5,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    r = client.completions.create(model=MODEL, prompt="?", max_tokens=10,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40,
                                       response_format={"type": "json_object"}, seed=4,
                                       temperature=0.8)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tools(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0.7, seed=1)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=80, temperature=0.7, seed=2)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    # the call goes back into the conversation through the template
    follow = client.chat.completions.create(model=MODEL, max_tokens=4, tools=[WEATHER],
                                            messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_side_endpoints_and_a_refusal(client, cluster, tiny_path: Path) -> None:
    import httpx
    import openai

    base = cluster.url
    models = client.models.list().data
    assert models[0].id == MODEL
    raw = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert raw["root"] == str(tiny_path) and raw["max_model_len"] == 1024
    tok = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "abc"}).json()
    assert tok["tokens"] == [97, 98, 99] and tok["max_model_len"] == 1024
    assert httpx.post(f"{base}/detokenize", json={"tokens": [104, 105]}).json() == {
        "prompt": "hi"}
    assert httpx.get(f"{base}/version").json()["version"]
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"use_beam_search": True})
    # a grammar the engine cannot compile: a 400 naming the field it came in
    with pytest.raises(openai.BadRequestError, match="regex") as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex"
