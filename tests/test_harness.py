"""lm-evaluation-harness at every budget: the ``looptool`` lm-eval model (``looptool.eval.harness``)
against lm-eval's own ``hf`` model on the source, on three tasks defined here over local
JSONL files (multiple choice, rolling log-likelihood, generate_until), and ``looptool lm-eval``."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.core.errors import MissingExtraError
from looptool.core.install import install_command
from looptool.testing import byte_tokenizer, tiny_model

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'looptool[eval]')")
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from looptool.eval import harness, lm_eval_budgets  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = ("lt_choice", "lt_rolling", "lt_generate")
PLANS = {
    "prefix": looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)),
    "recurrent": looptool.RecurrentLoop(recurrent=(1, 2), max_loops=2, init="exact"),
}
MODEL_ARGS = dict(max_length=32, batch_size=4)  # 32 tokens: the rolling task's documents span several windows
LAYERS = 3  # the time goes into torch.export captures (convert, load, the decode step), which grow with depth


def _task_configs() -> dict[str, dict]:
    def local(name: str) -> dict:
        return {
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(DATA / name)}},
            "test_split": "test",
        }

    return {
        "lt_choice": {
            **local("mc.jsonl"),
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        },
        "lt_rolling": {
            **local("docs.jsonl"),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        },
        "lt_generate": {
            **local("gen.jsonl"),
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "exact_match"}],
            "generation_kwargs": {"until": ["Q:"], "max_gen_toks": 8, "do_sample": False},
        },
    }


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """lm-eval task YAMLs over tests/data/lm_eval/*.jsonl (absolute paths, so any cwd works)."""
    path = tmp_path_factory.mktemp("tasks")
    for name, config in _task_configs().items():
        (path / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **config}))
    return path


@pytest.fixture(scope="module")
def manager(task_dir):
    return lm_eval_budgets.task_manager(TASKS, [str(task_dir)])


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """A tiny Llama with the byte tokenizer, saved as a Hugging Face model directory."""
    path = tmp_path_factory.mktemp("source") / "src"
    tiny_model("llama", num_layers=LAYERS).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _evaluate(model, manager, tasks=TASKS, model_args=None) -> dict:
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(tasks), task_manager=manager, bootstrap_iters=0, log_samples=True
    )


def _numbers(out: dict) -> dict:
    """Every metric of every task, and every request's response (log-likelihoods, generated text)."""
    metrics = {t: {k: v for k, v in r.items() if "," in k} for t, r in out["results"].items()}
    responses = {t: [s["resps"] for s in samples] for t, samples in out["samples"].items()}
    return {"metrics": metrics, "responses": responses}


@pytest.fixture(scope="module")
def reference(source_dir, manager) -> dict:
    """lm-eval's own ``hf`` model on the source directory."""
    args = {"pretrained": str(source_dir), "dtype": "float32", "device": "cpu", **MODEL_ARGS}
    return _numbers(_evaluate("hf", manager, model_args=args))


@pytest.fixture(scope="module")
def looped_lm(source_dir):
    """``plan name -> LooptoolLM`` of the source (loaded from its directory) converted with
    that plan, in memory (``pretrained=DIR`` is the CLI test's path)."""
    cache: dict[str, harness.LooptoolLM] = {}

    def get(name: str) -> harness.LooptoolLM:
        if name not in cache:
            import transformers

            source = transformers.AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
            model = looptool.convert(source, PLANS[name], tokenizer=byte_tokenizer())
            cache[name] = harness.LooptoolLM(model, **MODEL_ARGS)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def looped_dir(looped_lm, tmp_path_factory) -> Path:
    """The prefix conversion saved with its tokenizer."""
    return looped_lm("prefix").model.save_pretrained(tmp_path_factory.mktemp("prefix") / "looped")


@pytest.mark.parametrize("plan", list(PLANS))
def test_every_budget_equals_hf_on_the_source(plan, looped_lm, manager, reference):
    """At a fresh conversion every budget's metrics, log-likelihoods and generations are
    exactly lm-eval's ``hf`` numbers for the source model."""
    lm = looped_lm(plan)
    assert lm.model.budgets == {"prefix": (0, 1, 2), "recurrent": (1, 2)}[plan]
    assert set(reference["metrics"]) == set(TASKS)
    assert reference["metrics"]["lt_rolling"]["byte_perplexity,none"] > 1
    for k in lm.model.budgets:
        lm.budget = k
        got = _numbers(_evaluate(lm, manager))
        assert got["metrics"] == reference["metrics"], f"budget {k}"
        assert got["responses"] == reference["responses"], f"budget {k}"


def test_perturbed_budget_differs_from_the_source(looped_lm, manager, reference):
    """Non-zero loop gates change the deeper budgets' numbers (so the equality above can
    fail), while budget 0 still runs the source path."""
    lm = looped_lm("prefix")
    gates = dict(lm.model.new_parameters())
    saved = {name: p.detach().clone() for name, p in gates.items()}
    try:
        with torch.no_grad():
            for p in gates.values():
                p.fill_(1.0)
        tasks = ("lt_choice", "lt_rolling")
        numbers = {}
        for k in (0, 2):
            lm.budget = k
            numbers[k] = _numbers(_evaluate(lm, manager, tasks))
        assert numbers[0]["metrics"] == {t: reference["metrics"][t] for t in tasks}
        deep, ref = numbers[2]["metrics"]["lt_rolling"], reference["metrics"]["lt_rolling"]
        assert deep["byte_perplexity,none"] != ref["byte_perplexity,none"]
        assert numbers[2]["responses"]["lt_choice"] != reference["responses"]["lt_choice"]
    finally:
        with torch.no_grad():
            for name, p in gates.items():
                p.copy_(saved[name])


def _generate(lm, prompts, until, max_gen_toks=12):
    requests = [
        Instance(
            request_type="generate_until",
            doc={},
            idx=0,
            arguments=(p, {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}),
        )
        for p in prompts
    ]
    return lm.generate_until(requests)


def test_generate_until_stops_at_until(looped_lm, monkeypatch):
    """The text ends before the first stop string, and decoding stops once every row holds one."""
    lm = looped_lm("prefix")
    lm.budget = 2
    prompts = ["Q: What is 2+3?\nA:", "Four score"]
    free = _generate(lm, prompts, until=[])
    row = free[0]
    stop = next(ch for ch in row[1:] if ch.isprintable() and ch != "\ufffd")  # a character the model writes
    steps = []
    real = harness.generate

    def counting(*args, on_step, **kwargs):
        return real(*args, on_step=lambda tokens: steps.append(len(tokens)) or on_step(tokens), **kwargs)

    monkeypatch.setattr(harness, "generate", counting)
    cut = _generate(lm, prompts[:1], until=[stop])
    assert cut == [row[: row.index(stop)]]
    assert 0 < len(steps) < 12  # stopped early, not after max_gen_toks tokens
    assert _generate(lm, prompts, until=[stop])[0] == cut[0]  # batched with a longer prompt: the same text


def test_python_m_harness_is_lm_evals_cli_with_looptool(monkeypatch):
    """``python -m looptool.eval.harness ARGS`` is lm-eval's own command line on ARGS, with the
    ``looptool`` model registered (lm-eval 0.4.13 has no plug-in entry points for models)."""
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    seen = {}
    monkeypatch.setattr(
        lm_eval.__main__, "cli_evaluate", lambda: seen.update(argv=sys.argv[1:], model=get_model("looptool"))
    )
    monkeypatch.setattr(sys, "argv", ["looptool.eval.harness"])
    harness.main(["--model", "looptool", "--tasks", "lt_choice"])
    assert seen == {"argv": ["--model", "looptool", "--tasks", "lt_choice"], "model": harness.LooptoolLM}
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models stay reachable


def test_cli_lm_eval_writes_table_json_and_plot(looped_dir, task_dir, reference, tmp_path):
    """``looptool lm-eval DIR --budgets all``: every budget of the saved model, loaded from its
    directory, scores what ``hf`` scores on the source; JSON, markdown table and PNG written."""
    out = tmp_path / "report"
    res = CliRunner().invoke(
        app,
        [
            "lm-eval",
            str(looped_dir),
            "--tasks",
            "lt_choice,lt_rolling",
            "--include-path",
            str(task_dir),
            "--budgets",
            "all",
            "--batch-size",
            "4",
            "--max-length",
            "32",
            "--bootstrap-iters",
            "10",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    result = json.loads((out / "lm_eval.json").read_text())
    assert [row["budget"] for row in result["budgets"]] == [0, 1, 2]
    assert [row["cost"]["layer_executions"] for row in result["budgets"]] == [LAYERS, LAYERS + 1, LAYERS + 2]
    for row in result["budgets"]:
        for task in ("lt_choice", "lt_rolling"):
            got = {m: v["value"] for m, v in row["results"][task].items()}
            assert got == {k.split(",")[0]: v for k, v in reference["metrics"][task].items() if "_stderr" not in k}
    assert result["budgets"][0]["results"]["lt_choice"]["acc"]["stderr"] > 0
    table = (out / "lm_eval.md").read_text()
    assert (
        "| budget | layers | ×FLOPs |" in table
        and "lt_choice acc ↑" in table
        and "lt_rolling byte_perplexity ↓" in table
    )
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 4  # header + 3 budgets
    assert (out / "lm_eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_lm_eval_results_appear_together_in_the_model_dir_and_git_stays_quiet(
    looped_dir, task_dir, tmp_path, monkeypatch, capfd
):
    """By default the results go into MODEL_DIR beside the model: a failure while plotting
    leaves none of lm_eval.json/.md/.png (and no staging folder), a success writes all three;
    run outside a git repository, lm-eval's git call prints nothing on stderr."""
    import shutil

    import looptool.report.plots

    model = tmp_path / "model"
    shutil.copytree(looped_dir, model)
    before = sorted(p.name for p in model.iterdir())
    monkeypatch.chdir(tmp_path)  # not a git repository
    args = [
        "lm-eval",
        str(model),
        "--tasks",
        "lt_choice",
        "--include-path",
        str(task_dir),
        "--budgets",
        "0",
        "--limit",
        "2",
        "--max-length",
        "32",
        "--bootstrap-iters",
        "0",
    ]

    def broken_plot(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(looptool.report.plots, "plot_quality_cost", broken_plot)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "plotting failed" in res.output
    assert sorted(p.name for p in model.iterdir()) == before  # nothing half-written, no staging folder left
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in model.iterdir()) == sorted([*before, "lm_eval.json", "lm_eval.md", "lm_eval.png"])
    assert "not a git repository" not in capfd.readouterr().err
    assert json.loads((model / "lm_eval.json").read_text())["budgets"][0]["budget"] == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tasks", " , "], "--tasks is empty"),
        (
            ["--tasks", "lt_choice", "--include-path", "no/such/folder"],
            "include_path 'no/such/folder' does not exist; pass a folder of lm-eval task YAMLs. (option --include-path)",
        ),
    ],
)
def test_cli_lm_eval_bad_input_is_one_sentence(tmp_path, args, message):
    res = CliRunner().invoke(app, ["lm-eval", str(tmp_path), *args, "-o", str(tmp_path / "out")])
    assert res.exit_code == 1
    assert message in res.output and res.output.count("error:") == 1
    assert not (tmp_path / "out").exists()


def test_missing_lm_eval_names_the_extra(monkeypatch, tmp_path):
    """Without lm-eval, importing the adapter and ``looptool lm-eval`` end in one sentence naming the extra."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "looptool.eval.harness")
    monkeypatch.delitem(sys.modules, "looptool.eval.lm_eval_budgets")  # the lm-eval runner imports the adapter
    with pytest.raises(MissingExtraError, match=re.escape(install_command("eval"))):
        importlib.import_module("looptool.eval.harness")
    res = CliRunner().invoke(app, ["lm-eval", str(tmp_path), "--tasks", "x"])
    assert res.exit_code == 1 and install_command("eval") in res.output
