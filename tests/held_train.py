"""``python tests/held_train.py ARGS...``: the looptool CLI in a process whose training run
does not end: it waits before its final checkpoint until it is killed. A test that kills a run
mid-way (``kill -9``, then ``--resume``) once it has logged some steps kills it before it
could end, at any machine speed, instead of racing the steps left against its own polling.
Under ``torchrun`` it is the script every rank runs."""

from __future__ import annotations

import runpy
import sys
import threading

from looptool.train.trainer import Trainer

_checkpoint = Trainer._checkpoint


def _held_checkpoint(self: Trainer, step: int) -> None:
    """:meth:`Trainer._checkpoint`, except the final one: there the run waits for its kill."""
    if step == self.total_steps:
        threading.Event().wait()
    _checkpoint(self, step)


Trainer._checkpoint = _held_checkpoint

if __name__ == "__main__":
    sys.argv = ["looptool", *sys.argv[1:]]
    runpy.run_module("looptool", run_name="__main__", alter_sys=True)
