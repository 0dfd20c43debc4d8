"""The server's pure parts without a server: the budget resolver and its effort ladder, stop
strings across token boundaries, and the capacity check."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

from looptool.core.errors import LooptoolError  # noqa: E402
from looptool.serve.budgets import BudgetChoiceError, BudgetResolver, default_ladder, parse_effort  # noqa: E402
from looptool.serve.prompts import check_room  # noqa: E402
from looptool.serve.protocol import APIError  # noqa: E402
from looptool.serve.text import TextStream  # noqa: E402
from looptool.testing import byte_tokenizer  # noqa: E402

MENU = (0, 3, 6, 9, 12)


def test_default_ladder_spreads_the_levels_over_the_menu():
    assert default_ladder(MENU) == {
        "none": 0,
        "minimal": 0,
        "low": 3,
        "medium": 6,
        "high": 9,
        "xhigh": 12,
        "max": 12,
    }
    assert default_ladder((1, 2)) == {"none": 1, "minimal": 1, "low": 1, "medium": 2, "high": 2, "xhigh": 2, "max": 2}
    assert set(default_ladder((4,)).values()) == {4}


def test_effort_override_maps_named_levels_and_rounds_the_rest_to_the_nearest():
    ladder = parse_effort("low=0,high=12", MENU)
    assert ladder["low"] == 0 and ladder["high"] == 12
    assert ladder["minimal"] == 0 and ladder["none"] == 0  # nearest: low
    assert ladder["xhigh"] == 12 and ladder["max"] == 12  # nearest: high
    assert ladder["medium"] == 0  # equally near low and high: the cheaper
    assert parse_effort("medium=6", MENU) == dict.fromkeys(default_ladder(MENU), 6)


@pytest.mark.parametrize("text", ["low", "huge=3", "low=x", "low=4", ""])
def test_bad_effort_is_one_sentence(text):
    with pytest.raises(LooptoolError) as err:
        parse_effort(text, MENU)
    assert err.value.parameter == "effort" and str(err.value).endswith(".")


def test_resolver_takes_one_of_model_budget_and_effort():
    r = BudgetResolver.create("m", MENU, default=6)
    assert r.model_ids() == ["m", "m@0", "m@3", "m@6", "m@9", "m@12"]
    assert r.resolve("m") == 6 and r.resolve("m@9") == 9
    assert r.resolve("m", budget=3) == 3 and r.resolve("m", effort="xhigh") == 12
    assert r.resolve("m@3", budget=3, effort="low") == 3  # agreeing choices are fine
    with pytest.raises(BudgetChoiceError) as err:
        r.resolve("m@3", budget=6)
    assert err.value.status == 400 and err.value.parameter == "budget"
    for model in ("other", "m@5", "m@x", "m@"):
        with pytest.raises(BudgetChoiceError) as err:
            r.resolve(model)
        assert err.value.status == 404 and err.value.code == "model_not_found"
    assert BudgetResolver.create("m", MENU).default == 12  # default: the deepest
    with pytest.raises(LooptoolError, match="default_budget 5"):
        BudgetResolver.create("m", MENU, default=5)


def test_stop_strings_are_found_across_token_boundaries_and_held_back_until_sure():
    tok = byte_tokenizer()
    stream = TextStream(tok, ["END", "!!"])
    sent = [stream.push(t) for t in tok("abcEN")["input_ids"]]
    assert "".join(sent) == "abc"  # "EN" might start "END": held back
    assert stream.push(tok("D")["input_ids"][0]) == "" and stream.stopped and stream.text == "abc"
    plain = TextStream(tok)
    assert "".join(plain.push(t) for t in tok("no stops")["input_ids"]) + plain.finish() == "no stops"
    held = TextStream(tok, ["xyz"])
    assert "".join(held.push(t) for t in tok("abxy")["input_ids"]) + held.finish() == "abxy"  # the end releases it


def test_room_check_names_prompt_or_max_tokens():
    check_room(10, 54, 64)
    with pytest.raises(APIError) as err:
        check_room(64, None, 64)
    assert err.value.parameter == "prompt" and err.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as err:
        check_room(10, 55, 64)
    assert err.value.parameter == "max_tokens" and "at most 54" in str(err.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/dir"], "is not a directory"),
        (["/no/such/dir", "--max-batch", "0"], "--max-batch must be at least 1"),
        (["/no/such/dir", "--kv", "bogus"], "unknown KV cache policy"),
        (["/no/such/dir", "--max-queue", "-1"], "max_queue must be at least 0"),
    ],
)
def test_cli_bad_input_is_one_sentence_before_any_load(args, message):
    from typer.testing import CliRunner

    from looptool.cli import app

    res = CliRunner().invoke(app, ["serve", *args])
    assert res.exit_code == 1 and message in res.output, res.output
