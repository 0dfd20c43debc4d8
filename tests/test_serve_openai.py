"""The rest of the OpenAI API through the official ``openai`` client, on PyTorch and onnxruntime:
``n`` choices, presence / frequency / repetition penalties, ``min_p``, ``logit_bias``, chat
``top_logprobs``, structured outputs (``response_format``, ``guided_regex``,
``guided_choice``, ``guided_grammar``), tool calls, ``/tokenize`` and ``/detokenize``, and the
OpenAI fields the server refuses.

One server per runtime (4 slots) over a tiny fixed-prefix model (new parameters non-zero)
whose EOS is the NUL byte, so a grammar may ask for newlines (the Hermes tool-call format
does). Answers are checked against an independent reference: the shared prefill-then-decode
loop on the same runtime with this file's own copy of vLLM's penalty formulas, or against the
property the field promises (JSON that validates, text the expression matches, calls that
parse); requests of other budgets run in the same batches.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serve_process import PLACE_SCHEMA, WEATHER_TOOL, metric, served_on, tiny_looped

import looptool
from looptool.engine.sampling import SamplingParams

openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install 'looptool[test]')")
pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'looptool[serve]')")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks use jsonschema (pip install 'looptool[test]')")

NAME = "tiny"
BUDGETS = (0, 1, 2)
EOS = 0
SCHEMA = PLACE_SCHEMA
WEATHER = WEATHER_TOOL
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string", "maxLength": 4}},
            "required": ["q"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    plan = looptool.PrefixLoop(window=(1, 3), budgets=BUDGETS)
    return tiny_looped(tmp_path_factory.mktemp("openai") / NAME, plan, seed=3, eos=EOS)


@pytest.fixture(scope="module")
def model(model_dir):
    return looptool.load(model_dir)


@pytest.fixture(scope="module", params=("pytorch", "onnxruntime"))
def served(request, model_dir, model, tmp_path_factory):
    return served_on(request.param, model_dir, model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    proc = served.start("--max-batch", "4", "--capacity", "1280", log=tmp_path_factory.mktemp("log") / "s")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="dummy", max_retries=0, timeout=120)


def ids_of(model, text: str) -> list[int]:
    return model.tokenizer(text)["input_ids"]


def decoded(model, tokens: list[int]) -> str:
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def vllm_penalties(presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0, bias=None, prompt: int = 0):
    """vLLM's logits processing, written out here: logit_bias added, then the repetition penalty
    over prompt and output tokens (divide positive logits, multiply the rest), the frequency
    penalty per output occurrence and the presence penalty once per output token."""

    def shape(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        out = logits.clone()
        for token, value in (bias or {}).items():
            out[0, token] += value
        output = history[prompt:]
        for token in set(history):
            if repetition != 1:
                out[0, token] = out[0, token] / repetition if out[0, token] > 0 else out[0, token] * repetition
        for token in set(output):
            out[0, token] -= frequency * output.count(token) + presence
        return out

    return shape


# ---------------------------------------------------------------------- sampling parity
def test_n_choices_equal_separate_requests_seeded_one_apart(client, model):
    settings = dict(model=f"{NAME}@1", prompt="Four score and", max_tokens=10, temperature=1.0)
    r = client.completions.create(n=3, seed=11, **settings)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=11 + j, **settings).choices[0].text for j in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1  # different seeds, different samples
    assert r.usage.prompt_tokens == len(ids_of(model, "Four score and"))
    assert r.usage.completion_tokens == sum(len(ids_of(model, t)) for t in alone) or r.usage.completion_tokens >= 3
    chat = dict(model=f"{NAME}@2", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=1.0)
    whole = client.chat.completions.create(n=2, seed=5, **chat)
    texts = {0: "", 1: ""}
    for part in client.chat.completions.create(n=2, seed=5, stream=True, **chat):
        for c in part.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert whole.choices[1].message.content == client.chat.completions.create(seed=6, **chat).choices[0].message.content


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
        {"repetition_penalty": 1.4},
        {"logit_bias": {"101": 6.0, "32": -100}},
        {"presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 2.0, "temperature": 0.8, "seed": 3},
    ],
    ids=["presence", "frequency", "repetition", "logit_bias", "all-sampled"],
)
def test_penalties_and_logit_bias_follow_vllms_formulas_in_a_mixed_batch(client, served, model, fields):
    prompt = "the the the cat sat on the mat and the"
    ids = ids_of(model, prompt)
    body = {"temperature": 0.0, **fields}
    extra = {k: body.pop(k) for k in ("repetition_penalty",) if k in body}

    def ask(i: int):
        if i == 0:
            r = client.completions.create(model=f"{NAME}@2", prompt=prompt, max_tokens=24, extra_body=extra, **body)
        else:  # plain requests of other budgets share its steps
            r = client.completions.create(model=f"{NAME}@{i % 2}", prompt=f"plain {i}", max_tokens=24, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(ask, range(3)))
    bias = {int(k): v for k, v in fields.get("logit_bias", {}).items()}
    shape = vllm_penalties(
        fields.get("presence_penalty", 0.0),
        fields.get("frequency_penalty", 0.0),
        fields.get("repetition_penalty", 1.0),
        bias,
        prompt=len(ids),
    )
    sampling = SamplingParams(temperature=fields.get("temperature", 0.0), seed=fields.get("seed"))
    want = served.alone(ids, 2, 24, sampling, shape=shape)
    assert got[0] == decoded(model, want)
    assert got[0] != decoded(model, served.alone(ids, 2, 24, sampling))  # the field changed the text
    for i in (1, 2):
        assert got[i] == decoded(model, served.alone(ids_of(model, f"plain {i}"), i % 2, 24))


def test_min_p_keeps_tokens_near_the_most_likely(client, model):
    def sampled(min_p: float):
        r = client.completions.create(
            model=f"{NAME}@1", prompt="Liberty", max_tokens=32, temperature=1.0, seed=2, logprobs=20,
            extra_body={"min_p": min_p},
        )  # fmt: skip
        lp = r.choices[0].logprobs
        return [(v, max(top.values())) for v, top in zip(lp.token_logprobs, lp.top_logprobs)]

    kept = sampled(0.8)
    assert all(v >= best + math.log(0.8) - 1e-4 for v, best in kept)
    assert any(v < best + math.log(0.8) for v, best in sampled(0.0))  # without it, less likely tokens are drawn


def test_chat_top_logprobs_streamed_and_not_match_completions(client, server, model):
    messages = [{"role": "user", "content": "name a colour"}]
    prompt = httpx.post(
        server.base.removesuffix("/v1") + "/tokenize", json={"model": NAME, "messages": messages}, timeout=30
    ).json()["tokens"]
    chat = client.chat.completions.create(
        model=f"{NAME}@1", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy takes the most likely
        assert bytes(e.bytes).decode(errors="replace") == e.token
    plain = client.completions.create(model=f"{NAME}@1", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    assert [e.logprob for e in entries] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    streamed = []
    for part in client.chat.completions.create(
        model=f"{NAME}@1", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    ):
        if part.choices and part.choices[0].logprobs is not None:
            streamed += part.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    chunks = list(
        client.completions.create(
            model=f"{NAME}@1", prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert tokens == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)


# ---------------------------------------------------------------------- structured outputs
def test_json_schema_answers_validate_on_every_sample_beside_plain_requests(client, served, server, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}

    def ask(i: int):
        if i % 2:
            r = client.completions.create(model=f"{NAME}@{i % 3}", prompt=f"plain {i}", max_tokens=16, temperature=0)
            return "plain", i, r
        r = client.chat.completions.create(
            model=f"{NAME}@{i % 3}", messages=[{"role": "user", "content": f"place {i}"}], n=2, seed=i,
            temperature=1.0, max_tokens=140, response_format=fmt,
        )  # fmt: skip
        return "json", i, r

    before = metric(server.metrics(), "looptool_forced_tokens_total", budget="0")
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    forced = 0
    for kind, i, r in got:
        if kind == "plain":
            assert r.choices[0].text == decoded(model, served.alone(ids_of(model, f"plain {i}"), i % 3, 16))
            continue
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
        forced += r.model_extra["cost"]["forced_tokens"]
        assert r.model_extra["cost"]["forced_tokens"] > 0  # keys and punctuation took no step
    after = metric(server.metrics(), "looptool_forced_tokens_total", budget="0")
    assert after > before
    text = "".join(
        part.choices[0].delta.content or ""
        for part in client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=140,
            temperature=0,
            stream=True,
            response_format=fmt,
        )  # fmt: skip
        if part.choices
    )
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.completions.create(
        model=f"{NAME}@0",
        prompt="{",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # the completions API has no response_format of its own: vLLM takes it as an extra field
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)


def test_guided_regex_choice_and_grammar(client):
    def text(**extra):
        r = client.completions.create(
            model=f"{NAME}@1", prompt="code:", max_tokens=40, temperature=1.0, seed=4, n=3, extra_body=extra
        )
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.text for c in r.choices]

    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in text(guided_regex=r"[0-9]{3}-[a-z]{2,4}"))
    assert set(text(guided_choice=["yes", "no", "a.b (c)"])) <= {"yes", "no", "a.b (c)"}
    got = text(guided_grammar='root ::= "x" ("+" [0-9])+')
    assert all(re.fullmatch(r"x(\+[0-9])+", t) for t in got)


# ---------------------------------------------------------------------- tool calls
def test_forced_tool_calls_parse_and_follow_the_schema_streamed_and_not(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, reason in ((named, "stop"), ("required", "tool_calls")):
        r = client.chat.completions.create(
            model=f"{NAME}@2", messages=messages, tools=[WEATHER, LOOKUP], tool_choice=choice, max_tokens=120,
            temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == reason and c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        schema = {"get_weather": WEATHER, "lookup": LOOKUP}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        if choice is named:
            assert call.function.name == "get_weather"
        calls: dict[int, dict] = {}
        for part in client.chat.completions.create(
            model=f"{NAME}@2", messages=messages, tools=[WEATHER, LOOKUP], tool_choice=choice, max_tokens=120,
            temperature=0, parallel_tool_calls=False, stream=True,
        ):  # fmt: skip
            for d in (part.choices[0].delta.tool_calls or []) if part.choices else []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            if part.choices and part.choices[0].finish_reason:
                assert part.choices[0].finish_reason == reason
        assert list(calls.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]


@pytest.mark.parametrize("served", ["pytorch"], indirect=True)  # the parser reads text: the HTTP side alone
def test_auto_tool_calls_are_read_from_the_text_and_none_leaves_text(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    messages = [{"role": "user", "content": "weather?"}]
    regex = re.escape("Sure. " + call).replace("\\\n", "\n")
    r = client.chat.completions.create(
        model=f"{NAME}@1", messages=messages, tools=[WEATHER], max_tokens=120, temperature=0,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Oslo", "unit": "c"}
    r = client.chat.completions.create(
        model=f"{NAME}@1", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=120, temperature=0,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [c.message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "12 C"},
    ]
    again = client.chat.completions.create(
        model=f"{NAME}@1", messages=follow, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert again.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


# ---------------------------------------------------------------------- tokenize, refusals
# (the HTTP side alone: the same on every runtime, so served on PyTorch only)
HTTP_ONLY = pytest.mark.parametrize("served", ["pytorch"], indirect=True)


@HTTP_ONLY
def test_tokenize_and_detokenize_as_vllm(server, model):
    root = server.base.removesuffix("/v1")
    got = httpx.post(f"{root}/tokenize", json={"model": NAME, "prompt": "héllo"}, timeout=30).json()
    assert (
        got["tokens"] == ids_of(model, "héllo") and got["count"] == len(got["tokens"]) and got["max_model_len"] == 1280
    )
    assert httpx.post(f"{root}/detokenize", json={"model": NAME, "tokens": got["tokens"]}, timeout=30).json() == {
        "prompt": "héllo"
    }
    bad = httpx.post(f"{root}/detokenize", json={"model": NAME, "tokens": [999]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{root}/tokenize", json={"model": "nope", "prompt": "a"}, timeout=30).status_code == 404


@HTTP_ONLY
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"logit_bias": {"999": 5}}, "logit_bias"),
        ({"logit_bias": {"a": 5}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"guided_json": {"type": "bogus"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"n": 2, "draft_budget": 0, "presence_penalty": 1}, "draft_budget"),
    ],
)
def test_the_new_fields_out_of_range_are_one_400_naming_them(server, fields, param):
    r = httpx.post(f"{server.base}/completions", json={"model": f"{NAME}@2", "prompt": "a", **fields}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@HTTP_ONLY
@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("chat/completions", "modalities", ["text", "audio"]),
        ("chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("chat/completions", "web_search_options", {}),
        ("chat/completions", "functions", [{"name": "f"}]),
        ("chat/completions", "function_call", "auto"),
        ("chat/completions", "verbosity", "low"),
        ("completions", "suffix", "end"),
        ("completions", "best_of", 3),
    ],
)
def test_an_openai_field_the_server_does_not_serve_is_one_400_naming_it(server, path, field, value):
    body = {"model": NAME, "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "a"}]} if path.startswith("chat") else {"prompt": "a"}
    r = httpx.post(f"{server.base}/{path}", json={**body, field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    fine = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "modalities": ["text"]}
    assert httpx.post(f"{server.base}/{path}", json={**body, **fine}, timeout=30).status_code == 200
