"""``python tests/held_process.py HOLD [LAUNCHER.py] ARGS...``: the looptool CLI (or another
test launcher, such as ``fake_trt_process.py``) in a process whose server scheduler does not
advance its running rows while the file ``HOLD`` exists, until every one of them is cancelled.
A test that must know a request is still running when something happens (its client giving
up, say) creates ``HOLD``, acts, then removes it: the request outlasts its client by
construction, at any machine speed, instead of by a length that a fast machine decodes inside
the client's timeout, and can only leave the engine by being cancelled meanwhile."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from looptool.engine.core import EngineCore

HOLD = Path(sys.argv[1])
_iterate = EngineCore.iterate


def _held_iterate(self: EngineCore) -> None:
    """:meth:`EngineCore.iterate` once ``HOLD`` is gone or every running row is cancelled
    (cancelling and queueing go on meanwhile: only the running rows' next step waits). The
    running-requests gauge, which the scheduler sets after each iteration, is set first (the
    server's core reports to its metrics), so a test sees the held rows as running."""
    self.observer.running.set(len(self.rows))
    while HOLD.exists() and not all(row.job.cancelled for row in self.rows):
        time.sleep(0.01)
    _iterate(self)


EngineCore.iterate = _held_iterate

if __name__ == "__main__":
    rest = sys.argv[2:]
    if rest and rest[0].endswith(".py"):  # another launcher: it runs the CLI with the rest
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
    else:
        sys.argv = ["looptool", *rest]
        runpy.run_module("looptool", run_name="__main__", alter_sys=True)
