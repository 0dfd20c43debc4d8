"""``train_summary.json``: what a finished training run did, beside the model it saved."""

from __future__ import annotations

import json
import os
from pathlib import Path

from looptool.storage.files import result_files

SUMMARY_FILE = "train_summary.json"


def write_train_summary(output: str | os.PathLike, summary: dict) -> Path:
    """Write ``summary`` (what :meth:`looptool.train.trainer.Trainer.run` returns: steps, tokens
    per step, the budget draws expected by Eq. 3 and realised) as ``train_summary.json`` in the
    run's ``output`` directory, atomically; returns its path."""
    with result_files(output) as staging:
        (staging / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return Path(output) / SUMMARY_FILE
