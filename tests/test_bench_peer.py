"""tests/bench/bench_peer.py's pure parts (no onnxruntime-genai, no model): which ratios it
reports, their round-by-round values, the token check and the markdown tables; and
``interleaved(measured=True)``, the timing it relies on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from looptool.eval.timing import Timing, interleaved

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import bench_peer  # noqa: E402


def test_ratio_specs_pick_the_reported_ratios_of_the_arms_present():
    arms = {"genai_fp32", "genai_int4", "onnx_k0", "onnx_k6", "onnx_k12", "torch_k0", "hf_generate"}
    arms |= {"unrolled_k0", "unrolled_k12", "rowwise_k0"}
    specs = bench_peer.ratio_specs([0, 6, 12], [0, 12], 30, ["fp32", "int4"], arms)
    assert [(s.label, s.predicted) for s in specs] == [
        ("onnx_k0 ÷ genai_fp32", None),
        ("onnx_k6 ÷ onnx_k0", pytest.approx(36 / 30)),
        ("onnx_k12 ÷ onnx_k0", pytest.approx(42 / 30)),
        ("onnx_k0 ÷ unrolled_k0", None),  # the looped graph ÷ the budget's own unrolled graph
        ("onnx_k12 ÷ unrolled_k12", None),  # unrolled_k6 was not timed
        ("unrolled_k0 ÷ genai_fp32", None),
        ("rowwise_k0 ÷ unrolled_k0", None),  # rowwise_k12 was not timed
        ("torch_k0 ÷ hf_generate", None),
        ("genai_int4 ÷ genai_fp32", None),
    ]


def _timings(batches, per_arm: dict[str, list[float]]) -> dict[str, Timing]:
    """Timings of every arm at every batch: the arm's seconds, times the batch."""
    return {f"b{b}/{name}": Timing(tuple(v * b for v in values)) for b in batches for name, values in per_arm.items()}


def test_ratio_rows_are_round_by_round_and_flag_noise():
    timings = _timings([1, 8], {"onnx_k0": [1.0, 1.1, 1.2], "genai_fp32": [2.0, 2.0, 2.0]})
    (row,) = bench_peer.ratio_rows(timings, [bench_peer.RatioSpec("onnx_k0", "genai_fp32")], [1, 8])
    assert row["ratio"] == "onnx_k0 ÷ genai_fp32" and row["predicted"] is None
    b1 = row["batches"]["1"]
    assert (b1["min"], b1["median"], b1["max"]) == pytest.approx((0.5, 0.55, 0.6))
    assert not b1["noisy"] and b1["cell"] == "0.550 ±9.1%"
    one_round = _timings([1], {"a": [1.0], "b": [2.0]})
    (row,) = bench_peer.ratio_rows(one_round, [bench_peer.RatioSpec("a", "b")], [1])
    assert row["batches"]["1"]["noisy"] and row["batches"]["1"]["cell"] == "noisy"


def test_compare_tokens_counts_differing_rows_from_the_first_differing_step():
    ref = torch.tensor([[1, 2, 5, 6, 7], [1, 2, 5, 6, 7], [1, 2, 5, 6, 7]])
    assert bench_peer.compare_tokens(ref.clone(), ref, 2) == {
        "same": True,
        "rows": 3,
        "rows_differ": 0,
        "first_step": None,
    }
    got = ref.clone()
    got[1, 4] = 9
    got[2, 3] = 9
    t = bench_peer.compare_tokens(got, ref, 2)
    assert t == {"same": False, "rows": 3, "rows_differ": 2, "first_step": 1}
    assert bench_peer.tokens_cell(t) == "2/3 rows differ from token 1"
    got[0, 0] = 9  # the prompt is not compared
    assert bench_peer.compare_tokens(got, ref, 2)["rows_differ"] == 2
    assert not bench_peer.compare_tokens(ref[:, :4], ref, 2)["same"]  # fewer tokens


def test_compare_tokens_stops_each_row_at_its_first_eos():
    """The reference suppresses EOS to decode a fixed number of steps; an arm that emits EOS is
    compared up to it, and not from there on."""
    ref = torch.tensor([[1, 2, 5, 6, 7, 8], [1, 2, 5, 6, 7, 8]])
    got = torch.tensor([[1, 2, 5, 0, 4, 4], [1, 2, 5, 6, 7, 9]])  # row 0 emits EOS (0) where ref has 6
    assert not bench_peer.compare_tokens(got, ref, 2)["same"]
    t = bench_peer.compare_tokens(got, ref, 2, eos=0)
    assert t == {"same": False, "rows": 2, "rows_differ": 1, "first_step": 3}  # row 1's last token
    got[1, 5] = 8
    assert bench_peer.compare_tokens(got, ref, 2, eos=0)["same"]
    got[0, 2] = 3  # a token before the EOS still counts
    assert bench_peer.compare_tokens(got, ref, 2, eos=0) == {
        "same": False,
        "rows": 2,
        "rows_differ": 1,
        "first_step": 0,
    }


def test_markdown_has_an_arm_table_and_a_ratio_table():
    ms = {"min_ms": 10.0, "median_ms": 11.04, "max_ms": 12.0, "n": 3}
    same = {"same": True, "rows": 1, "rows_differ": 0, "first_step": None}
    diff = {"same": False, "rows": 8, "rows_differ": 8, "first_step": 5}
    result = {
        "batches": [1, 8],
        "arms": {
            "b1/genai_fp32": {"arm": "genai_fp32", "ms_per_step": ms, "tokens": same},
            "b1/onnx_k0": {"arm": "onnx_k0", "ms_per_step": ms, "tokens": same},
            "b8/genai_fp32": {"arm": "genai_fp32", "ms_per_step": ms, "tokens": same},
            "b8/onnx_k0": {"arm": "onnx_k0", "ms_per_step": ms, "tokens": diff},
        },
        "ratios": [
            {
                "ratio": "onnx_k12 ÷ onnx_k0",
                "predicted": 1.4,
                "batches": {"1": {"cell": "1.300 ±2.0%"}, "8": {"cell": "noisy"}},
            }
        ],
    }
    text = bench_peer.markdown(result).splitlines()
    assert text[0].startswith("| arm (ms per decode step) | batch 1: min / median / max | batch 8:")
    assert "| genai_fp32 | 10.0 / 11.0 / 12.0 | 10.0 / 11.0 / 12.0 | same |" in text
    assert "| onnx_k0 | 10.0 / 11.0 / 12.0 | 10.0 / 11.0 / 12.0 | same · 8/8 rows differ from token 5 |" in text
    assert "| ratio | batch 1 | batch 8 | predicted |" in text
    assert "| onnx_k12 ÷ onnx_k0 | 1.300 ±2.0% | noisy | 1.400 |" in text


def test_interleaved_records_what_each_function_measured():
    calls = []

    def arm(name, seconds):
        def fn():
            calls.append(name)
            return seconds

        return fn

    t = interleaved({"a": arm("a", 0.5), "b": arm("b", 2.0)}, repeats=2, warmup=1, measured=True)
    assert t["a"].samples == (0.5, 0.5) and t["b"].samples == (2.0, 2.0)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # order rotated each round, the warm-up included


def test_the_missing_peer_names_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails
    with pytest.raises(SystemExit, match="pip install onnxruntime-genai"):
        bench_peer.require_peer()
