"""Structured outputs, penalties and ``n`` in the engine core, in process: the logits formulas
against this file's own copy of vLLM's, jump-forward decoding against masked decoding (the
same tokens on a byte-level vocabulary, fewer steps, every row of a mixed batch equal to it
alone), adaptive-depth rows spending no depth on forced tokens, the copies of one prefill,
and the two xgrammar limits :mod:`looptool.serve.structured` closes (raw control characters in
length-bounded strings, invalid UTF-8 from byte tokens)."""

from __future__ import annotations

import json

import pytest
import torch
from serve_process import PLACE_SCHEMA, tiny_looped

import looptool
from looptool.core.errors import LooptoolError
from looptool.engine import open_engine
from looptool.engine.budgets import AutoRow
from looptool.engine.core import EngineCore, Job
from looptool.engine.sampling import SamplingParams, shape_logits
from looptool.testing import byte_tokenizer

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'looptool[serve]')")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks use jsonschema (pip install 'looptool[test]')")

from looptool.serve.structured import Grammars, GrammarSpec, Utf8Guard, bounded_strings  # noqa: E402

EOS = 0
SCHEMA = PLACE_SCHEMA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    plan = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
    return tiny_looped(tmp_path_factory.mktemp("structured") / "tiny", plan, seed=5, eos=EOS)


@pytest.fixture(scope="module")
def opened(model_dir):
    return open_engine(model_dir, runtime="pytorch", device="cpu")


@pytest.fixture(scope="module")
def grammars(opened):
    return Grammars(opened.tokenizer, opened.engine.vocab_size, opened.eos)


def schema_row(grammars):
    spec = GrammarSpec("json_schema", json.dumps(bounded_strings(SCHEMA), sort_keys=True), "response_format")
    return grammars.row(grammars.compile(spec), spec)


def run(opened, specs: list[dict], jump: bool = True, max_batch: int = 8) -> tuple[list[list], int]:
    """Each spec's events (jobs admitted one after another, then decoded together) and the steps."""
    core = EngineCore(opened.engine, max_batch=max_batch, capacity=512, eos=opened.eos, jump_forward=jump)
    events: list[list] = [[] for _ in specs]
    for i, spec in enumerate(specs):
        job = Job(**spec)
        job.emit = events[i].append
        core.prefill([job])
    while core.rows:
        core.iterate()
        core.retire()
    return events, core.steps


def tokens(events) -> list[int]:
    return [e.token for e in events if e.kind == "token"]


# ---------------------------------------------------------------------- logits formulas
def test_penalties_and_bias_follow_vllms_formulas():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=gen) * 3
    prompt, output = [1, 2, 2, 7], [7, 9, 9, 9, 30]
    sampling = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5, logit_bias=((3, 2.0), (9, -1.0))
    )
    got = shape_logits(logits, sampling, prompt + output, len(prompt), None)[0]
    want = logits[0].clone()
    for t in range(50):  # written out as vLLM's sampler does it, token by token
        x = float(want[t]) + {3: 2.0, 9: -1.0}.get(t, 0.0)
        if t in prompt or t in output:
            x = x / 1.5 if x > 0 else x * 1.5
        x -= 0.25 * output.count(t) + (0.5 if t in output else 0.0)
        assert float(got[t]) == pytest.approx(x, abs=1e-5), t
    assert torch.equal(shape_logits(logits, SamplingParams(), [1, 2], 1, None), logits)  # nothing asked: untouched


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": ((1, "x"),)}, "logit_bias"),
    ],
)
def test_sampling_settings_out_of_range_are_one_sentence_naming_them(kwargs, name):
    with pytest.raises(LooptoolError) as err:
        SamplingParams(**kwargs)
    assert err.value.parameter == name and str(err.value).startswith(name)


# ---------------------------------------------------------------------- jump-forward decoding
def test_jump_forward_takes_forced_tokens_without_steps_and_changes_no_token(opened, grammars):
    tok = opened.tokenizer

    def specs():
        return [
            dict(prompt=tok("Weather: ")["input_ids"], budget=2, max_tokens=120, constraint=schema_row(grammars)),
            dict(prompt=tok("We the People")["input_ids"], budget=0, max_tokens=40),
            dict(prompt=tok("Hello")["input_ids"], budget=1, max_tokens=120, constraint=schema_row(grammars)),
            dict(
                prompt=tok("abc")["input_ids"], budget=1, max_tokens=30, sampling=SamplingParams(repetition_penalty=1.3)
            ),
        ]

    jumped, jump_steps = run(opened, specs(), jump=True)
    masked, masked_steps = run(opened, specs(), jump=False)
    assert [tokens(e) for e in jumped] == [tokens(e) for e in masked]  # one way to spell each byte
    forced = [sum(e.forced for e in ev) for ev in jumped]
    assert forced[0] > 10 and forced[2] > 10 and forced[1] == forced[3] == 0
    assert not any(e.forced for ev in masked for e in ev)
    assert all(e.depth is None for ev in jumped for e in ev if e.forced)
    for i in (0, 2):
        text = tok.decode(tokens(jumped[i]), skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    for i, spec in enumerate(specs()):  # each row of the mixed batch equals it alone
        alone, _ = run(opened, [spec], jump=True)
        assert tokens(alone[0]) == tokens(jumped[i]), i
    lone, lone_steps = run(opened, [specs()[0]], jump=True)
    _, lone_masked_steps = run(opened, [specs()[0]], jump=False)
    assert lone_steps < lone_masked_steps - 10  # the forced tokens took no step


@pytest.mark.parametrize(
    ("model_type", "plan"),
    [
        ("llama", looptool.RecurrentLoop(recurrent=(1, 2), max_loops=3)),
        ("qwen3_moe", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    ],
    ids=["elr", "moe"],
)
def test_jump_forward_equals_masked_decoding_on_elr_and_moe(tmp_path, model_type, plan):
    opened = open_engine(tiny_looped(tmp_path / "m", plan, seed=5, eos=EOS, model_type=model_type), runtime="pytorch")
    grammars = Grammars(opened.tokenizer, opened.engine.vocab_size, opened.eos)
    tok, low, high = opened.tokenizer, min(opened.engine.budgets), max(opened.engine.budgets)

    def specs():
        return [
            dict(prompt=tok("Weather: ")["input_ids"], budget=high, max_tokens=120, constraint=schema_row(grammars)),
            dict(prompt=tok("We the People")["input_ids"], budget=low, max_tokens=30),
        ]

    jumped, jump_steps = run(opened, specs(), jump=True)
    masked, masked_steps = run(opened, specs(), jump=False)
    assert [tokens(e) for e in jumped] == [tokens(e) for e in masked] and jump_steps < masked_steps
    jsonschema.validate(json.loads(tok.decode(tokens(jumped[0]), skip_special_tokens=True)), SCHEMA)
    for i, spec in enumerate(specs()):
        assert tokens(run(opened, [spec])[0][0]) == tokens(jumped[i]), i


def test_adaptive_rows_spend_no_depth_on_forced_tokens(model_dir, grammars):
    opened = open_engine(model_dir, runtime="pytorch", device="cpu", kv="last-loop")
    prompt = opened.tokenizer("Weather: ")["input_ids"]
    auto = AutoRow(0, 2, 0.05)
    spec = dict(prompt=prompt, budget=2, max_tokens=120, auto=auto, constraint=schema_row(grammars))
    (events,), _ = run(opened, [spec])
    chosen = [e for e in events if e.kind == "token" and not e.forced]
    forced = [e for e in events if e.kind == "token" and e.forced]
    assert forced and all(e.depth is None for e in forced)
    assert all(0 <= e.depth <= 2 for e in chosen)
    jsonschema.validate(json.loads(opened.tokenizer.decode(tokens(events), skip_special_tokens=True)), SCHEMA)


# ---------------------------------------------------------------------- n choices
def test_copies_of_a_job_share_its_prefill_and_equal_separate_jobs(opened):
    calls = []
    engine = opened.engine
    real = engine.run

    def counted(cache, batch):
        calls.append(batch.input_ids.shape[1])
        return real(cache, batch)

    engine.run = counted
    try:
        prompt = opened.tokenizer("Four score and seven years")["input_ids"]
        lead = Job(prompt, 1, 10, SamplingParams(temperature=1.0, seed=3))
        lead.copies = [Job(prompt, 1, 10, SamplingParams(temperature=1.0, seed=3 + j)) for j in (1, 2)]
        got: list[list] = [[], [], []]
        for job, sink in zip([lead, *lead.copies], got):
            job.emit = sink.append
        core = EngineCore(engine, max_batch=4, capacity=64, eos=())
        core.prefill([lead])
        while core.rows:
            core.iterate()
            core.retire()
        assert sum(1 for t in calls if t > 1) == 1  # one prefill for three choices
    finally:
        engine.run = real
    for j, events in enumerate(got):
        (alone,), _ = run(
            opened, [dict(prompt=prompt, budget=1, max_tokens=10, sampling=SamplingParams(1.0, seed=3 + j))]
        )
        assert tokens(events) == tokens(alone)
    assert len({tuple(tokens(e)) for e in got}) > 1


# ---------------------------------------------------------------------- xgrammar's limits
def test_length_bounded_strings_compile_as_patterns():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 2, "maxLength": 5},
            "b": {"type": "array", "items": {"type": "string", "maxLength": 3}},
            "c": {"type": "string", "maxLength": 4, "pattern": "^x+$"},
            "d": {"type": "string", "enum": ["yes"], "maxLength": 3},
        },
    }
    out = bounded_strings(schema)["properties"]
    assert out["a"] == {"type": "string", "pattern": "^.{2,5}$"}
    assert out["b"]["items"] == {"type": "string", "pattern": "^.{0,3}$"}
    assert out["c"] == schema["properties"]["c"] and out["d"] == schema["properties"]["d"]
    info = xgr.TokenizerInfo.from_huggingface(byte_tokenizer(EOS), vocab_size=256, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    raw = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"]}

    def controls(schema) -> list[int]:
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        for byte in b'{"s": "':
            assert matcher.accept_token(byte)
        mask = xgr.allocate_token_bitmask(1, 256)
        matcher.fill_next_token_bitmask(mask)
        return [t for t in range(32) if int(mask[0, t // 32]) >> (t % 32) & 1]

    assert controls(raw)  # xgrammar's length path lets raw control characters into a JSON string
    assert controls(bounded_strings(raw)) == []


def test_the_utf8_guard_allows_exactly_the_tokens_that_continue_valid_utf8():
    vocab = [
        b"a",
        b"\xc3",
        b"\xa9",
        b"\xe0",
        b"\xa0\x80",
        b"\x80\x80",
        b"\xed\xa0\x80",
        b"\xf0\x9f",
        b"\x98\x80",
        b"<s>",
    ]
    guard = Utf8Guard(vocab, len(vocab) + 2, special=[9])
    start = guard.allowed[0].tolist()
    assert start == [True, True, False, True, False, False, False, True, False, True, True, True]
    after_c3 = int(guard.after[0, 1])
    assert guard.allowed[after_c3].tolist()[:9] == [False, False, True, False, False, False, False, False, False]
    after_e0 = int(guard.after[0, 3])
    assert guard.allowed[after_e0, 4] and not guard.allowed[after_e0, 5]  # E0 needs A0-BF next (no overlong form)
    after_f0 = int(guard.after[0, 7])
    assert int(guard.after[after_f0, 8]) == 0  # 😀 complete
    assert not start[6] and not start[5]  # a surrogate's bytes; continuation bytes with nothing to continue
