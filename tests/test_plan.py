"""PrefixLoop plans: defaults, validation, serialisation, cost model."""

from __future__ import annotations

import pytest

from looptool.core.errors import PlanError
from looptool.core.plan import (
    ModelDims,
    PrefixLoop,
    cost_table,
    parse_budgets,
    parse_window,
    plan_from_dict,
)


def test_defaults_follow_accordion():
    plan = PrefixLoop().resolve(24)
    assert plan.window == (6, 18)  # Accordion's layers 7-18 of 24, 0-based half-open
    assert plan.budgets == (0, 3, 6, 9, 12)
    assert PrefixLoop(window=(8, 20)).resolve(30).budgets == (0, 3, 6, 9, 12)
    assert PrefixLoop(window=(0, 2)).resolve(4).budgets == (0, 1, 2)


def test_repeated_layers_is_the_prefix():
    plan = PrefixLoop(window=(8, 20), budgets=(0, 3, 12)).resolve(30)
    assert plan.repeated_layers(0) == ()
    assert plan.repeated_layers(3) == (8, 9, 10)
    assert plan.layer_executions(12, 30) == 42


@pytest.mark.parametrize(
    "window,budgets,message",
    [
        ((5, 5), None, "not a non-empty range"),
        ((3, 2), None, "not a non-empty range"),
        ((0, 31), None, "inside the model's 30 layers"),
        ((-1, 4), None, "not a non-empty range"),
        ((8, 20), (0, 13), "budget 13 is outside 0..12"),
        ((8, 20), (0, 2.5), "whole numbers"),
        ((8, 20), ("3",), "whole numbers"),
        ((8, 20), (3, 3), "without repeats"),
        ((8, 20), (), "non-empty"),
    ],
)
def test_invalid_plans_are_refused(window, budgets, message):
    with pytest.raises(PlanError, match=message):
        PrefixLoop(window=window, budgets=budgets).resolve(30)


def test_round_trip_and_version_check():
    plan = PrefixLoop(window=(8, 20), budgets=(0, 6, 12)).resolve(30)
    assert plan_from_dict(plan.to_dict()) == plan
    data = plan.to_dict() | {"version": 99}
    with pytest.raises(PlanError, match="format version 99"):
        plan_from_dict(data)
    with pytest.raises(PlanError, match="unknown loop plan kind"):
        plan_from_dict({"kind": "spiral"})


def test_cli_parsers():
    assert parse_window("8:20") == (8, 20)
    assert parse_budgets("0, 3,6") == (0, 3, 6)
    with pytest.raises(PlanError, match="START:STOP"):
        parse_window("8-20")
    with pytest.raises(PlanError, match="not a whole number"):
        parse_budgets("0,x")


def test_cost_table_matches_eq6():
    plan = PrefixLoop(window=(2, 6), budgets=(0, 2, 4)).resolve(8)
    dims = ModelDims(num_layers=8, layer_flops=(10.0,) * 8, fixed_flops=20.0, kv_bytes_per_layer=4, param_bytes=0)
    rows = {r.budget: r for r in cost_table(plan, dims)}
    assert rows[0].flops_per_token == 20 + 80
    assert rows[4].flops_per_token == 20 + 120  # C_fixed + (L + k) C_layer
    assert rows[2].relative_kv == pytest.approx(10 / 8)  # (L + k) / L
    assert rows[4].layer_executions == 12
