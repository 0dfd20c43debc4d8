"""Every default of every command runs: each command once with only what it requires.

A user's first try is the defaults (a TensorRT export with its default precision once failed
while every test passed ``precision="fp32"``). Each invocation below gives a command its
required arguments and nothing else, except the options in ``OVERRIDES``, each with the
reason the default cannot run here (how much work it is, or what this machine lacks). The
walker test fails when a command of the app has no invocation, or when an invocation sets an
option that is neither required nor listed, so a new option's default cannot slip through.
The invocations run in order on one tiny model (each later command uses what earlier ones
wrote), in this file's own worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_demo import table_width
from test_harness import _task_configs
from typer.main import get_command
from typer.testing import CliRunner

from looptool.backends.manifest import Manifest
from looptool.cli import app
from looptool.core.graph import ROWWISE
from looptool.testing import byte_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]
SOTU = ROOT / "tests" / "data" / "sotu"

# (command, parameter): why the invocation may not leave it at its default
OVERRIDES = {
    ("train", "tokens"): "the default 2M tokens is a real training run (500 steps); 2 steps show the rest",
    ("rl", "steps"): "50 steps of 8 prompts x 16 rollouts is a real run; 2 small steps show the rest",
    ("rl", "prompts"): "as --steps",
    ("rl", "rollouts"): "as --steps",
    ("rl", "max_new_tokens"): "as --steps",
    ("distill", "steps"): "50 steps is a real run; 2 small steps show the rest",
    ("distill", "prompts"): "as --steps",
    ("distill", "max_new_tokens"): "as --steps",
    ("export", "backend"): "the second export invocation: --backend tensorrt, so its own defaults run too",
    ("export", "build_on_target"): "building engines needs TensorRT and a GPU, which this machine lacks",
    ("export", "budget"): "the TensorRT invocation exports one budget; 'all' runs in the onnx invocation",
    ("merge", "experts"): "merging needs an expert; the argument is optional only for --list-groups",
    ("merge", "output"): "as EXPERTS (required unless --list-groups)",
    ("merge", "lambdas"): "a merge needs at least one λ spec: no default weight suits every merge (mergekit also asks)",
    ("lm-eval", "include_path"): "lm-eval's own tasks download data sets; the local task lives in a folder of its own",
}


@dataclass(frozen=True)
class Workspace:
    """The paths the invocations read and write."""

    root: Path

    def __getattr__(self, name: str) -> str:  # w.looped → ROOT/looped
        return str(self.root / name)


def invocations(w: Workspace) -> list[list[str]]:
    """Every command's defaults invocation, in the order they run."""
    data, prompts = str(SOTU / "17*.txt"), str(w.root / "prompts.jsonl")
    return [
        ["convert", w.source, "-o", w.looped],
        ["inspect", w.looped],
        ["train", w.looped, "--data", data, "-o", w.trained, "--tokens", str(2 * 8 * 512)],
        ["plot", w.trained],
        ["eval", w.trained, "--data", data],
        ["analyze", w.trained, "--data", data],
        ["generate", w.trained, "--prompt", "We the People"],
        [
            "rl",
            w.trained,
            "--data",
            prompts,
            "-o",
            w.rl,
            "--steps",
            "2",
            "--prompts",
            "2",
            "--rollouts",
            "2",
            "--max-new-tokens",
            "4",
        ],
        [
            "distill",
            w.looped,
            "--teacher",
            f"math={w.rl}",
            "--data",
            prompts,
            "-o",
            w.distilled,
            "--steps",
            "2",
            "--prompts",
            "2",
            "--max-new-tokens",
            "4",
        ],
        ["merge", w.looped, w.rl, "-o", w.merged, "--lambda", "0.5"],
        ["lm-eval", w.trained, "--tasks", "lt_choice", "--include-path", w.tasks],
        ["export", w.trained, "-o", w.engine],
        ["run", w.engine, "--prompt", "We the People"],
        ["serve", w.trained],
        ["export", w.trained, "-o", w.trt, "--backend", "tensorrt", "--build-on-target", "--budget", "0"],
        ["demo"],
    ]


def _params_given(command, args: list[str]) -> tuple[set[str], list[str]]:
    """The names of the parameters ``args`` sets, and the positional arguments."""
    ctx = command.make_context(command.name, list(args), resilient_parsing=True)
    given = {name for name in ctx.params if ctx.get_parameter_source(name).name == "COMMANDLINE"}
    return given, ctx.args


def test_every_command_has_a_defaults_invocation_that_sets_only_what_it_must():
    group = get_command(app)
    runs = invocations(Workspace(Path("/w")))
    assert {args[0] for args in runs} == set(group.commands), "a command without a defaults invocation"
    for args in runs:
        command = group.commands[args[0]]
        given, _ = _params_given(command, args[1:])
        required = {p.name for p in command.params if p.required}
        assert required <= given, (args[0], required - given)
        extra = {p for p in given - required if (args[0], p) not in OVERRIDES}
        assert not extra, f"{args[0]} sets {sorted(extra)} without a reason in OVERRIDES"
    used = {(args[0], p) for args in runs for p in _params_given(group.commands[args[0]], args[1:])[0]}
    assert set(OVERRIDES) <= used, f"stale OVERRIDES: {sorted(set(OVERRIDES) - used)}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    """A tiny Llama source with a tokenizer, RL prompts and an lm-eval task folder."""
    import yaml

    root = tmp_path_factory.mktemp("defaults")
    tiny_model("llama", num_layers=4).save_pretrained(root / "source")
    byte_tokenizer().save_pretrained(root / "source")
    (root / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "domain": "math"}) + "\n"
            for a in range(3)
            for b in range(3)
        )
    )
    (root / "tasks").mkdir()
    (root / "tasks" / "lt_choice.yaml").write_text(
        yaml.safe_dump({"task": "lt_choice", **_task_configs()["lt_choice"]})
    )
    return Workspace(root)


def _check(args: list[str], w: Workspace, output: str) -> None:
    """What each command must have written or printed at its defaults."""
    name = args[0]
    if name == "convert":
        plan = json.loads(Path(w.looped, "looptool.json").read_text())["plan"]
        assert plan["window"] == [1, 3] and plan["budgets"] == [0, 1, 2], plan  # the middle half, m/4 steps
    elif name == "train":
        summary = json.loads(Path(w.trained, "train_summary.json").read_text())
        assert summary["steps"] == 2 and summary["tokens_per_step"] == 8 * 512
    elif name == "plot":
        assert Path("train_loss.png").stat().st_size > 0  # default output, in the working directory
    elif name == "eval":
        result = json.loads(Path(w.trained, "eval.json").read_text())
        assert [r["budget"] for r in result["budgets"]] == [0, 1, 2] and result["seq_len"] == 512
    elif name == "analyze":
        assert Path(w.trained, "analysis", "analysis.json").exists()
    elif name in ("generate", "run"):
        assert "We the People" in output
    elif name in ("rl", "distill", "merge"):
        assert Path(getattr(w, {"rl": "rl", "distill": "distilled", "merge": "merged"}[name]), "looptool.json").exists()
    elif name == "lm-eval":
        result = json.loads(Path(w.trained, "lm_eval.json").read_text())
        assert [r["budget"] for r in result["budgets"]] == [0, 1, 2]
    elif name == "export" and "tensorrt" in args:
        assert Manifest.read(w.trt).tensorrt.precision == "fp16"  # the default precision of an fp32 model
    elif name == "export":
        manifest = Manifest.read(w.engine)
        assert manifest.kv_policies == ("per-loop",) and manifest.dtype == "float32"
        # one looped graph serves every budget: no per-budget graph beside it
        assert manifest.budgets == () and manifest.graph(ROWWISE, "per-loop").menu == (0, 1, 2)
        assert manifest.graph(ROWWISE, "per-loop").form == "loop"
    elif name == "serve":
        assert "serving trained, trained@0, trained@1, trained@2 at http://127.0.0.1:8000/v1" in output
    elif name == "demo":
        assert "every budget is bit-identical to the source model" in output
        assert "interleaved rounds" not in output and "looptool demo --timing" in output  # timing is opt-in
        generated = [line.split(":")[0].split()[-1] for line in output.splitlines() if line.startswith("  budget ")]
        assert generated == ["0", "3", "6", "9", "12"], output  # one greedy continuation per budget
        assert table_width(output) <= 100


@pytest.mark.parametrize(
    "index",
    range(len(invocations(Workspace(Path("/w"))))),
    ids=[" ".join(a[:1] + [x for x in a if x == "tensorrt"]) for a in invocations(Workspace(Path("/w")))],
)
def test_command_runs_with_its_defaults(index, workspace, tmp_path, monkeypatch, request):
    args = invocations(workspace)[index]
    if args[0] == "demo":
        request.getfixturevalue("smollm2_gguf")  # the default source; skipped with pip's reason where unreachable
    if args[0] == "serve":  # loading and preparing at the defaults runs here; the HTTP side is tests/test_serve.py's
        from looptool.serve.server import Server

        monkeypatch.setattr(Server, "run", lambda self: None)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, f"{' '.join(args)}\n{res.output}"
    _check(args, workspace, res.output)
