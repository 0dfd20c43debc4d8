"""Where a looped model runs: device names, their checks, and dtype support.

One place turns a user's ``device`` into a ``torch.device`` (default: ``cuda`` when
CUDA is available, else ``cpu``) and refuses what the machine cannot do, one sentence each.
"""

from __future__ import annotations

import os

import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted

AUTO = "auto"


class DeviceError(LooptoolError):
    """A device or dtype the machine does not have or support."""


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` → ``cuda`` if available else ``cpu``; ``"cuda"`` under torchrun →
    ``cuda:$LOCAL_RANK``; refuses devices this machine lacks."""
    if name is None or str(name) == AUTO:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(
            f"device {name!r} is not a device name; use cpu, cuda or cuda:N.", parameter="device"
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {name} was asked for but this machine has no usable CUDA device "
                "(torch.cuda.is_available() is False); use device='cpu'.",
                parameter="device",
            )
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        if device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {device} does not exist: this machine has "
                f"{counted(torch.cuda.device_count(), 'CUDA device')}, cuda:0 to cuda:{torch.cuda.device_count() - 1}.",
                parameter="device",
            )
    elif device.type not in ("cpu", "meta"):
        raise DeviceError(f"device {name!r} is not supported; use cpu, cuda or cuda:N.", parameter="device")
    return device


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a weight dtype the device cannot compute in."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"{device} ({torch.cuda.get_device_name(device)}) does not support bfloat16; "
            "convert or load the model with dtype=torch.float32 (or torch.float16) for this GPU.",
            parameter="dtype",
            rerun="convert",
        )


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (``cpu`` for a module without any)."""
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
