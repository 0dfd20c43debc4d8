"""Atomic, resumable checkpoints of a training run, shared by ``looptool train``, ``rl`` and
``distill``.

A checkpoint is the whole output directory: the model (a loadable looped model), the run's
text files (settings, step log) and :data:`STATE_FILE` (step, optimizer state, every RNG
state, history and whatever else the run needs to go on), written into a temp directory and
renamed over the previous one (:func:`~looptool.storage.files.commit_output_dir`), so a kill
at any moment leaves the last complete checkpoint. Resuming refuses changed settings: data
order, budget draws and sampling seeds are functions of the step and the settings, so the
same settings replay the interrupted run exactly.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.storage.files import check_output_dir, commit_output_dir, recover_interrupted_commit
from looptool.storage.save import write_model

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork

STATE_FILE = "trainer_state.pt"


class RunComplete(LooptoolError):
    """A resume of a run that has already run all its steps (nothing to do; not a failure)."""


def rng_states(device: torch.device) -> dict:
    """Every RNG state a step may draw from: torch (CPU and the CUDA device), Python's
    ``random`` and NumPy's global generators (user reward functions may use them)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_states(states: dict, device: torch.device) -> None:
    """Restore what :func:`rng_states` saved (entries a run saved before they existed are skipped)."""
    torch.set_rng_state(states["torch"].cpu())
    if device.type == "cuda" and states.get("cuda") is not None:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
    if states.get("python") is not None:
        random.setstate(states["python"])
    if states.get("numpy") is not None:
        np.random.set_state(states["numpy"])


def write_checkpoint(
    output: Path,
    model: LoopedNetwork,
    state: dict | None,
    files: dict[str, str],
    *,
    materialize=None,
    save_state: bool = True,
) -> None:
    """Rebuild ``output`` atomically from ``model``, ``state`` (saved as :data:`STATE_FILE`)
    and the text ``files`` (name → content); ``save_state=False`` leaves :data:`STATE_FILE`
    out (the model and files only: a final model, which cannot be resumed).

    ``state=None``: this process does not write (a non-zero rank); it only materialises the
    tensors, which under FSDP is a collective every rank takes part in (``materialize`` as
    in :func:`~looptool.storage.save.write_model`)."""
    if state is None:
        write_model(model, None, materialize=materialize)
        return
    temp = output.with_name(f".{output.name}.ckpt.tmp")
    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        write_model(model, temp, materialize=materialize)
        if save_state:
            torch.save(state, temp / STATE_FILE)
        for name, text in files.items():
            (temp / name).write_text(text)
        commit_output_dir(output, temp)
    except BaseException:  # a failed or interrupted write leaves the previous checkpoint only
        shutil.rmtree(temp, ignore_errors=True)
        raise


def has_checkpoint(output: Path) -> bool:
    """Whether ``output`` holds a checkpoint, after undoing a commit killed between its renames."""
    recover_interrupted_commit(output)
    return (output / STATE_FILE).exists()


def open_output(output: Path, *, resume: bool, overwrite: bool = False) -> bool:
    """Check the output directory of a run that writes nothing until its first checkpoint;
    returns whether it resumes one. With ``resume`` an existing output must hold a checkpoint
    (without one it starts afresh); without it an existing output needs ``overwrite``."""
    if resume and has_checkpoint(output):
        return True
    if resume and output.exists() and not overwrite:
        raise LooptoolError(
            f"output directory '{output}' holds no checkpoint to resume (no {STATE_FILE}); "
            "choose another output, or set overwrite to replace it."
        )
    check_output_dir(output, overwrite or resume)
    return False


def checkpoint_step(output: Path) -> int | None:
    """The step of the checkpoint in ``output`` (None: there is none); cheap (memory-mapped)."""
    if not has_checkpoint(output):
        return None
    return int(torch.load(output / STATE_FILE, weights_only=False, mmap=True, map_location="cpu")["step"])


def resumable_state(
    output: Path,
    config,
    free: set[str],
    total_steps: int,
    device: torch.device,
    error: type[LooptoolError] = LooptoolError,
) -> dict:
    """The state of the checkpoint in ``output``, once checked (before any slow work): its
    settings must be the dataclass ``config``'s, except the ``free`` fields (where it runs,
    how often it saves), and it must have steps left of its ``total_steps``."""
    state = torch.load(output / STATE_FILE, weights_only=False, map_location=device)
    saved, now = state["config"], dataclasses.asdict(config)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # runs saved before a field existed
    diff = sorted(k for k in now if k not in free and saved.get(k, defaults.get(k)) != now[k])
    if diff:
        raise error(f"resume needs the same settings as the interrupted run; these settings differ: {', '.join(diff)}.")
    if state["step"] >= total_steps:
        raise RunComplete(
            f"the run in '{output}' is already complete ({counted(state['step'], 'step')}); nothing to resume."
        )
    return state
