"""The one progress display of every command: a list of steps on stderr, each a spinner
line while it runs and ✓ (or ✗ when it failed) once done; a step that knows how much work
it has shows a bar, done/total and the time left as well.

::

    with progress() as steps:
        with steps.stage(f"loading {path}"):
            model = load(path)
        with steps.stage("evaluating", total=len(budgets), done="evaluated") as step:
            for k in budgets:
                ...; step.advance(text=f"budget {k}")

A step is also the ``stage(text, total)`` callback library runs take
(:func:`looptool.eval.demo.run_demo`): ``steps.stage`` yields a callable that advances it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from looptool.cli.application import console


class _IfCounted(ProgressColumn):
    """``column`` for a step with a known total; nothing for a spinner step."""

    def __init__(self, column: ProgressColumn) -> None:
        self.column = column
        super().__init__()

    def render(self, task):
        return self.column.render(task) if task.fields.get("counted") else Text("")


class Step:
    """One running step: :meth:`advance` / :meth:`update` move its bar and change its text;
    calling it advances it by one (so it can be passed as an ``on_round`` callback)."""

    def __init__(self, progress: Progress, task: TaskID, text: str, counted: bool) -> None:
        self._progress, self._task, self.text, self.counted = progress, task, text, counted

    def __call__(self) -> None:
        self.advance()

    def advance(self, steps: int = 1, text: str | None = None) -> None:
        self.update(text=text)
        self._progress.advance(self._task, steps)

    def update(self, *, completed: int | None = None, total: int | None = None, text: str | None = None) -> None:
        if text is not None:
            self.text = text
        fields = {} if total is None else {"total": total, "counted": True}
        self.counted = self.counted or total is not None
        self._progress.update(self._task, completed=completed, description=self.text, **fields)

    def print(self, text: str) -> None:
        """A line above the progress display (plain text, no markup highlighting)."""
        self._progress.console.print(text, highlight=False)


class Steps:
    """The steps of one command (see the module docstring)."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    @contextmanager
    def stage(
        self, text: str, total: int | None = None, *, completed: int = 0, done: str | None = None
    ) -> Iterator[Step]:
        """A step named ``text`` (``total``: the units of work it counts); when the block ends
        it is marked ✓ with ``done`` (default: its last text), or ✗ if the block raised."""
        task = self._progress.add_task(text, total=total, completed=completed, counted=total is not None)
        step = Step(self._progress, task, text, counted=total is not None)
        try:
            yield step
        except BaseException as exc:
            resume = sys.modules.get("looptool.storage.resume")
            nothing_to_do = resume is not None and isinstance(exc, resume.RunComplete)  # a resume of a finished run
            self._progress.update(task, description=f"{'[yellow]–[/]' if nothing_to_do else '[red]✗[/]'} {step.text}")
            raise
        total = next(t.total for t in self._progress.tasks if t.id == task) if step.counted else 1
        self._progress.update(task, total=total, completed=total, description=f"[green]✓[/] {done or step.text}")


@contextmanager
def progress(*, disable: bool = False) -> Iterator[Steps]:
    """The progress display of a command, on stderr (``disable``: show nothing, e.g. on the
    ranks of a torchrun job other than rank 0)."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        _IfCounted(BarColumn()),
        _IfCounted(MofNCompleteColumn()),
        TimeElapsedColumn(),
        _IfCounted(TimeRemainingColumn()),
    )
    with Progress(*columns, console=console, transient=False, disable=disable) as bar:
        yield Steps(bar)
