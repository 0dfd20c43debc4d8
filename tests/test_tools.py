"""Tool calling in the Hermes / Qwen format without a model: the checks of ``tools`` and
``tool_choice``, reading calls from whole and streamed text (any split of a text streams to what
the whole text parses to), the grammar that forces calls (driven by random logits through
xgrammar), and the prompt with and without a template that knows tools."""

from __future__ import annotations

import itertools
import json
import random

import pytest

pytest.importorskip("pydantic", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

from serve_process import WEATHER_TOOL  # noqa: E402

from looptool.core.errors import LooptoolError  # noqa: E402
from looptool.serve.protocol import APIError  # noqa: E402
from looptool.serve.tools import PARSERS, ToolRequest, check_tools, parser_for  # noqa: E402
from looptool.testing import byte_tokenizer  # noqa: E402

WEATHER = WEATHER_TOOL
LOOKUP = {"type": "function", "function": {"name": "lookup"}}
TOOLS = check_tools([WEATHER, LOOKUP], None, None)
HERMES = parser_for("hermes")


def ids():
    return (f"call_{i:024x}" for i in itertools.count())


# ---------- check_tools


def test_check_tools_defaults_and_normalises():
    assert check_tools(None, None, None) is None
    assert check_tools([], "none", None) is None
    assert TOOLS == ToolRequest((WEATHER, LOOKUP), "auto", True)
    assert TOOLS.names == ("get_weather", "lookup") and TOOLS.forced is None
    named = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather", "x": 1}}, False)
    assert named.choice == {"type": "function", "function": {"name": "get_weather"}}
    assert named.forced == "get_weather" and named.parallel is False
    assert check_tools([LOOKUP], "required", True).choice == "required"


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param", "message"),
    [
        ({"a": 1}, None, None, "tools", "tools must be a list of tool objects."),
        (["x"], None, None, "tools.0", 'tools.0 must be an object, got "x".'),
        ([{"type": "web", "function": {}}], None, None, "tools.0.type", "tools.0.type must be 'function', got 'web'."),
        ([{"type": "function"}], None, None, "tools.0.function", "tools.0.function must be an object with a name."),
        (
            [LOOKUP, {"type": "function", "function": {"name": "bad name"}}],
            None,
            None,
            "tools.1.function.name",
            "tools.1.function.name must be 1 to 64 letters, digits, underscores or dashes, got 'bad name'.",
        ),
        (
            [{"type": "function", "function": {"name": "a" * 65}}],
            None,
            None,
            "tools.0.function.name",
            "tools.0.function.name must be 1 to 64",
        ),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            None,
            None,
            "tools.0.function.description",
            "tools.0.function.description must be a string.",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            None,
            "tools.0.function.parameters",
            'tools.0.function.parameters must be a JSON schema of type "object"',
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            None,
            None,
            "tools.0.function.strict",
            "tools.0.function.strict must be true or false.",
        ),
        (
            [LOOKUP, WEATHER, LOOKUP],
            None,
            None,
            "tools.2.function.name",
            "tools.2.function.name 'lookup' repeats tools.0's name; names must be unique.",
        ),
        (
            [LOOKUP],
            "any",
            None,
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or a function, got 'any'.",
        ),
        ([LOOKUP], 3, None, "tool_choice", "tool_choice must be a string or a function object."),
        ([LOOKUP], {"type": "tool"}, None, "tool_choice.type", "tool_choice.type must be 'function', got 'tool'."),
        (
            [LOOKUP],
            {"type": "function", "function": {"name": "get_weather"}},
            None,
            "tool_choice.function.name",
            "tool_choice.function.name must be one of the declared tools (lookup), got 'get_weather'.",
        ),
        (None, "required", None, "tool_choice", "tool_choice needs tools; send tools or leave tool_choice out."),
        ([], "auto", None, "tool_choice", "tool_choice needs tools"),
        ([LOOKUP], None, "true", "parallel_tool_calls", "parallel_tool_calls must be true or false."),
    ],
)
def test_check_tools_refuses_naming_the_field(tools, choice, parallel, param, message):
    with pytest.raises(APIError) as caught:
        check_tools(tools, choice, parallel)
    assert caught.value.parameter == param and caught.value.status == 400
    assert str(caught.value).startswith(message)


def test_parser_registry():
    assert set(PARSERS) >= {"hermes", "qwen"}
    assert type(parser_for("qwen")) is type(HERMES)
    with pytest.raises(LooptoolError, match=r"tool_call_parser 'mistral' is not known; use one of hermes, qwen") as e:
        parser_for("mistral")
    assert e.value.parameter == "tool_call_parser"


# ---------- parse and stream

CALL_W = '{"name": "get_weather", "arguments": {"city": "Paris",  "unit": "c", "days": [1, {"x": "}"}]} }'
TEXTS = [
    f"I will check.\n<tool_call>\n{CALL_W}\n</tool_call>\n<tool_call>\n"
    + '{"name": "lookup", "arguments": {}}\n</tool_call>',
    "plain text with < and <tool and <tool_cal> but no call.  \n",
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> after',
    'First <tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>',
    '<tool_call>not json</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"q": "a \\" </tool_call> b"}}\n'
    "</tool_call>\nDone.",
    f"Text <tool_call>\n{CALL_W}\n</tool_call>   trailing  \n",
    "  leading whitespace stays when there is no call\n",
    'Ça va? <tool_call>{"name":"lookup","arguments":{"q":"日本"}}</tool_call>',
    '<tool_call>\n{"name": "lookup", "arguments": "str"}\n</tool_call>',
    '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call> text <tool_call>',
    "<tool_call>\n[1, 2]\n</tool_call><tool_call>",
    "",
]


def assemble(deltas):
    """``(content, calls)`` from stream deltas, checking each delta's shape."""
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        if "id" in call:
            assert call["index"] == len(calls) and call["type"] == "function" and call["function"]["arguments"] == ""
            calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
        else:
            assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
            calls[-1]["function"]["arguments"] += call["function"]["arguments"]
    return (content or None) if calls else content, calls


def test_parse_reads_calls_and_keeps_malformed_blocks_as_text():
    content, calls = HERMES.parse(TEXTS[0], TOOLS, ids())
    assert content == "I will check."
    assert calls == [
        {
            "id": "call_" + "0" * 24,
            "type": "function",
            "function": {"name": "get_weather", "arguments": CALL_W[CALL_W.index('{"city"') : -2]},
        },
        {"id": f"call_{1:024x}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
    ]
    assert json.loads(calls[0]["function"]["arguments"])["days"] == [1, {"x": "}"}]
    assert HERMES.parse(TEXTS[1], TOOLS) == (TEXTS[1], [])
    assert HERMES.parse(TEXTS[2], TOOLS) == (TEXTS[2], [])  # an undeclared tool
    assert HERMES.parse(TEXTS[3], TOOLS, ids())[1][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
    }
    content, calls = HERMES.parse(TEXTS[4], TOOLS, ids())
    assert content == "<tool_call>not json</tool_call>Done."
    assert calls[0]["function"]["arguments"] == '{"q": "a \\" </tool_call> b"}'
    assert HERMES.parse(TEXTS[6], TOOLS) == (TEXTS[6], [])
    assert HERMES.parse(TEXTS[8], TOOLS) == (TEXTS[8], [])  # arguments that are not an object
    assert HERMES.parse(TEXTS[9], TOOLS, ids())[0] == "text <tool_call>"  # an unterminated block
    assert HERMES.parse(f"<tool_call>\n{CALL_W}\n</tool_call>", TOOLS)[0] is None
    real_id = HERMES.parse(TEXTS[7], TOOLS)[1][0]["id"]
    assert real_id.startswith("call_") and len(real_id) == 29 and int(real_id[5:], 16) >= 0
    none = check_tools([LOOKUP], "none", None)
    assert HERMES.parse(TEXTS[7], none) == (TEXTS[7], [])


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_streams_to_what_parse_reads(text):
    want = HERMES.parse(text, TOOLS, ids())
    rng = random.Random(text)
    for trial in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if text else []
        if trial == 0:
            cuts = list(range(1, len(text)))  # one character at a time
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = HERMES.stream(TOOLS, ids())
        deltas = [d for piece in pieces for d in stream.push(piece)] + stream.finish()
        assert assemble(deltas) == want, pieces
        assert stream.calls == len(want[1])


def test_stream_holds_back_tags_and_sends_the_name_first():
    stream = HERMES.stream(TOOLS, ids())
    assert stream.push("Sure <tool") == [{"content": "Sure"}]
    assert stream.push('_call>\n{"name": "get_wea') == []
    assert stream.push('ther", "arguments": {"ci') == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_" + "0" * 24,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
    ]
    assert stream.push('ty": "}"}}\n</tool') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "}"}'}}]}]
    assert stream.push("_call>\n\nOK") == [{"content": "OK"}]
    assert stream.finish() == [] and stream.calls == 1


def test_a_call_that_breaks_after_its_arguments_began():
    """Whole, the block is text; streamed, it was sent as a call before it broke."""
    text = '<tool_call>\n{"name": "lookup", "arguments": {"q": 1}} extra\n</tool_call> after'
    assert HERMES.parse(text, TOOLS) == (text, [])
    stream = HERMES.stream(TOOLS, ids())
    assert assemble(stream.push(text) + stream.finish()) == (text, [])
    stream = HERMES.stream(TOOLS, ids())
    cut = text.index('{"q"') + 2
    deltas = stream.push(text[:cut]) + stream.push(text[cut:]) + stream.finish()
    call = {"id": "call_" + "0" * 24, "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}
    assert assemble(deltas) == ("after", [call])


def test_stream_cut_off_inside_a_call_keeps_the_call():
    stream = HERMES.stream(TOOLS, ids())
    deltas = stream.push('<tool_call>\n{"name": "lookup", "arguments": {"q": "unfinish') + stream.finish()
    assert assemble(deltas) == (
        None,
        [
            {
                "id": "call_" + "0" * 24,
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": "unfinish'},
            }
        ],
    )
    stream = HERMES.stream(TOOLS, ids())
    assert assemble(stream.push("<tool_call>\n{") + stream.finish()) == ("<tool_call>\n{", [])


# ---------- the constraint, driven by random logits through xgrammar


def check_arguments(args: dict) -> None:
    schema = WEATHER["function"]["parameters"]
    assert set(schema["required"]) <= set(args) <= set(schema["properties"])
    assert isinstance(args["city"], str) and len(args["city"]) <= 8 and args["unit"] in ("c", "f")
    assert isinstance(args.get("days", 0), int)


def generate(xgr, torch, grammars, tag, seed: int, stop: int = 0, steps: int = 3000) -> tuple[str, bool]:
    """Greedy decoding of seeded random logits under the grammar, as the server masks a row
    (:class:`~looptool.serve.structured.GrammarRow`); the text and whether it ended."""
    from looptool.serve.structured import GrammarSpec

    spec = GrammarSpec("structural_tag", tag.model_dump_json(), "tool_choice")
    row = grammars.row(grammars.compile(spec), spec)
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        logits = torch.randn(256, generator=gen)
        row.mask(logits)
        token = int(logits.argmax())
        row.accept(token)
        if token == stop:
            return bytes(out).decode(), row.matcher.is_terminated()
        out.append(token)
    return bytes(out).decode(errors="replace"), False


@pytest.fixture(scope="module")
def grammar():
    xgr = pytest.importorskip("xgrammar")
    torch = pytest.importorskip("torch")
    from looptool.serve.structured import Grammars

    # NUL ends the text here: byte_tokenizer's EOS is the newline, which the format needs inside it
    return xgr, torch, Grammars(byte_tokenizer(0), 256, (0,))


def test_no_constraint_when_text_is_allowed():
    assert HERMES.constraint(TOOLS) is None
    assert HERMES.constraint(check_tools([LOOKUP], "none", None)) is None


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [({"type": "function", "function": {"name": "get_weather"}}, False), ("required", True), ("required", False)],
)
def test_constraint_forces_well_formed_calls(grammar, choice, parallel):
    # bounded arguments: random logits under an open object schema write for thousands of tokens
    bounded = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 4}}, "required": ["q"]}
    lookup = {
        "type": "function",
        "function": {"name": "lookup", "parameters": {**bounded, "additionalProperties": False}},
    }
    tools = check_tools([WEATHER, lookup], choice, parallel)
    tag = HERMES.constraint(tools)
    counts = set()
    for seed in range(20):
        text, ended = generate(*grammar, tag, seed)
        assert ended, text
        content, calls = HERMES.parse(text, tools, ids())
        assert content is None and calls and (parallel or len(calls) == 1), text
        counts.add(len(calls))
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            assert isinstance(args, dict)
            if call["function"]["name"] == "get_weather":
                check_arguments(args)
            else:
                assert not isinstance(choice, dict)
    assert not parallel or max(counts) > 1  # several calls do happen


def test_constraint_of_a_forced_tool_without_parameters_takes_an_object(grammar):
    tools = check_tools([WEATHER, LOOKUP], {"type": "function", "function": {"name": "lookup"}}, True)
    for seed in range(5):
        text, ended = generate(*grammar, HERMES.constraint(tools), seed)
        calls = HERMES.parse(text, tools)[1]
        assert ended and {c["function"]["name"] for c in calls} == {"lookup"}
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)


def test_newline_eos_cannot_write_the_format(grammar):
    """A tokenizer whose EOS is the newline (byte_tokenizer) cannot produce the calls: xgrammar keeps
    stop tokens for the end, and the format puts a newline right after ``<tool_call>``."""
    xgr, torch, _ = grammar
    info = xgr.TokenizerInfo.from_huggingface(byte_tokenizer(), vocab_size=256, stop_token_ids=[10])
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_structural_tag(HERMES.constraint(check_tools([LOOKUP], "required", None)))
    )
    for byte in b"<tool_call>":
        assert matcher.accept_token(byte)
    mask = xgr.allocate_token_bitmask(1, 256)
    matcher.fill_next_token_bitmask(mask)
    logits = torch.zeros(1, 256)
    xgr.apply_token_bitmask_inplace(logits, mask)
    assert torch.isinf(logits).all()


# ---------- render

QWEN_LIKE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
    {%- elif m.role != 'system' %}
        {{- '<|im_start|>' + m.role + '\n' + (m.content or '') }}
        {%- for c in m.tool_calls or [] %}
            {{- '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' }}
            {{- (c.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
SIMPLE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "tool", "tool_call_id": "c2", "content": "ok"},
]


def test_render_through_a_template_that_knows_tools():
    tok = byte_tokenizer()
    tok.chat_template = QWEN_LIKE
    text = tok.decode(HERMES.render(CHAT, TOOLS, tok))
    assert text.startswith(
        "<|im_start|>system\nBe terse.\n\n# Tools\n<tools>\n" + json.dumps(WEATHER, ensure_ascii=False)
    )
    assert (
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" not in tok.decode(HERMES.render(CHAT, check_tools([LOOKUP], "none", None), tok))


def test_render_falls_back_to_the_hermes_prompt():
    tok = byte_tokenizer()
    tok.chat_template = SIMPLE
    text = tok.decode(HERMES.render(CHAT, TOOLS, tok))
    assert text.startswith(
        "<system>Be terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    )
    assert f"<tools>\n{json.dumps(WEATHER, ensure_ascii=False)}\n{json.dumps(LOOKUP)}\n</tools>" in text
    assert "within <tool_call></tool_call> XML tags" in text
    assert text.endswith(
        '|<user>Weather in Paris?|<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>|'
        "<user><tool_response>\n18C\n</tool_response>\n<tool_response>\nok\n</tool_response>|<assistant>"
    )
    plain = tok.decode(HERMES.render(CHAT[:2], None, tok))
    assert plain == "<system>Be terse.|<user>Weather in Paris?|<assistant>"
    no_system = tok.decode(HERMES.render(CHAT[1:2], TOOLS, tok))
    assert no_system.startswith("<system># Tools\n\n") and no_system.endswith("|<user>Weather in Paris?|<assistant>")
