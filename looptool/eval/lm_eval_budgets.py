"""lm-evaluation-harness tasks at every budget of a looped model, in one process: the task
manager, one evaluation per budget through :class:`looptool.eval.harness.LooptoolLM`, and the
result with each budget's cost from the cost table. The files it writes are
:func:`looptool.eval.results.write_lm_eval`'s."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from looptool.core.errors import LooptoolError
from looptool.eval import harness  # imports lm-eval, or names the missing extra
from looptool.eval.harness import LooptoolLM
from looptool.runtime.model import LoopedModel


def task_manager(tasks: Sequence[str], include_path: Sequence[str] | None = None):
    """lm-eval's ``TaskManager`` for ``tasks``: only ``include_path`` when it defines them all
    (indexing lm-eval's ~15k built-in task files takes seconds), else the built-ins too; an
    unknown task name is refused in one sentence."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include_path or ()]
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise LooptoolError(
            f"include_path '{missing[0]}' does not exist; pass a folder of lm-eval task YAMLs.",
            parameter="include_path",
        )
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if manager is None or not set(tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise LooptoolError(
            f"lm-eval knows no task {', '.join(map(repr, unknown))}; check the name (lm_eval ls tasks) "
            "or pass the folder of its YAML as include_path.",
            parameter="tasks",
        )
    return manager


def evaluate_budgets(
    model: str | LoopedModel,
    tasks: Sequence[str],
    *,
    budgets: Sequence[int] | None = None,
    include_path: Sequence[str] | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    kv: str = "per-loop",
    device: str = "auto",
    max_length: int | None = None,
    bootstrap_iters: int = 100000,
    on_budget: Callable[[int, int, int], None] | None = None,
) -> dict:
    """Run lm-eval's ``simple_evaluate`` on ``tasks`` at every budget in ``budgets`` (default:
    all) of one loaded model; per budget: its cost (the cost table of ``looptool inspect``),
    wall seconds and every task's metrics with their standard errors. JSON-ready.
    ``on_budget(k, done, total)`` is called before each budget."""
    import time

    from lm_eval import simple_evaluate

    from looptool.report.tables import summary

    manager = task_manager(tasks, include_path)
    lm = LooptoolLM(model, kv=kv, batch_size=batch_size, device=device, max_length=max_length)
    chosen = [lm.model.check_budget(k) for k in (budgets if budgets is not None else lm.model.budgets)]
    costs = {row["budget"]: row for row in summary(lm.model)["budgets"]}
    rows, higher_is_better = [], {}
    for done, k in enumerate(chosen):
        if on_budget is not None:
            on_budget(k, done, len(chosen))
        lm.budget = k
        start = time.perf_counter()
        with _quiet_git_hash():
            out = simple_evaluate(
                model=lm,
                tasks=list(tasks),
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                bootstrap_iters=bootstrap_iters,
                log_samples=False,
            )
        seconds = time.perf_counter() - start
        higher_is_better = out.get("higher_is_better", {})
        rows.append(
            {
                "budget": k,
                "cost": costs[k],
                "seconds": seconds,
                "samples": {t: n.get("effective") for t, n in out.get("n-samples", {}).items()},
                "results": {task: _metrics(entry) for task, entry in out["results"].items()},
            }
        )
    return {
        "model": str(model) if not isinstance(model, LoopedModel) else None,
        "tasks": list(tasks),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "kv": kv,
        "batch_size": batch_size,
        "max_length": lm.max_length,
        "lm_eval_version": harness.lm_eval.__version__,
        "plan": lm.model.plan.to_dict(),
        "higher_is_better": higher_is_better,
        "budgets": rows,
    }


@contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """Within the block, lm-eval records the working directory's git hash as it does, but
    with git's stderr captured: lm-eval's own ``git describe`` lets git print ``fatal: not a
    git repository`` on the terminal whenever it runs outside one (nothing to act on)."""
    import lm_eval.evaluator

    def git_hash() -> str | None:
        try:
            return subprocess.run(
                ["git", "describe", "--always"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            from lm_eval.loggers.utils import get_commit_from_path

            return get_commit_from_path(os.getcwd())  # lm-eval's own fallback

    original = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original


def _metrics(entry: dict) -> dict[str, dict]:
    """``{"acc": {"value": .., "stderr": ..}}`` from one lm-eval results entry (``"acc,none"``,
    ``"acc_stderr,none"``); a filter other than ``none`` is kept in the name (``exact_match,flex``)."""
    out = {}
    for key, value in entry.items():
        metric, _, filt = key.partition(",")
        if not filt or metric.endswith("_stderr"):
            continue
        name = metric if filt == "none" else key
        out[name] = {"value": _number(value), "stderr": _number(entry.get(f"{metric}_stderr,{filt}"))}
    return out


def _number(value) -> float | None:
    """A float for JSON (lm-eval gives numpy scalars, and ``"N/A"`` for a missing stderr)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
