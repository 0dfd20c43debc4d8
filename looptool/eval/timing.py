"""Side-by-side timing: interleave the contenders so machine noise hits them all alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Wall times of one contender, in seconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        """Median sample."""
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        """Fastest sample."""
        return min(self.samples)

    @property
    def max(self) -> float:
        """Slowest sample."""
        return max(self.samples)

    def as_dict(self) -> dict:
        """JSON-ready summary (milliseconds)."""
        return {
            "min_ms": self.min * 1e3,
            "median_ms": self.median * 1e3,
            "max_ms": self.max * 1e3,
            "n": len(self.samples),
        }


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1, on_round=None
) -> dict[str, Timing]:
    """Run every function once per round, ``warmup`` untimed rounds then ``repeats`` timed
    ones, rotating the order each round; returns each function's timings."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for r in range(warmup + repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                _sync()
                t0 = time.perf_counter()
                fns[name]()
                _sync()  # CUDA runs asynchronously: time the work, not the launch
                dt = time.perf_counter() - t0
                if r >= warmup:
                    samples[name].append(dt)
            if on_round is not None:
                on_round()
    return {n: Timing(tuple(s)) for n, s in samples.items()}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
