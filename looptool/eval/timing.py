"""Side-by-side timing: interleave the contenders so machine noise hits them all alike, and
judge whether the rounds agree well enough to give a time ratio (:class:`Ratio`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Samples:
    """Measurements of one quantity over rounds: their median, smallest and largest."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        """Median sample."""
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        """Smallest sample."""
        return min(self.samples)

    @property
    def max(self) -> float:
        """Largest sample."""
        return max(self.samples)


@dataclass(frozen=True)
class Timing(Samples):
    """Wall times of one contender, in seconds."""

    def as_dict(self) -> dict:
        """JSON-ready summary (milliseconds)."""
        return {
            "min_ms": self.min * 1e3,
            "median_ms": self.median * 1e3,
            "max_ms": self.max * 1e3,
            "n": len(self.samples),
        }


# A ratio is a result when its per-round values span at most this fraction of their median
# (e.g. 1.00-1.15 around 1.08) over at least MIN_ROUNDS rounds; beyond it, it is noise.
RATIO_SPREAD_LIMIT = 0.2
MIN_ROUNDS = 3


@dataclass(frozen=True)
class Ratio(Samples):
    """One contender's time over another's, round by round: round ``i`` of each was timed
    side by side (:func:`interleaved`), so each round's ratio sees the same machine state
    (its median is the ratio reported)."""

    @property
    def spread(self) -> float:
        """How far the rounds disagree: ``(max - min) / median``."""
        return (self.max - self.min) / self.median

    @property
    def noisy(self) -> bool:
        """Whether the rounds cannot support a ratio: fewer than :data:`MIN_ROUNDS` of them, or
        a :attr:`spread` above :data:`RATIO_SPREAD_LIMIT`."""
        return len(self.samples) < MIN_ROUNDS or self.spread > RATIO_SPREAD_LIMIT

    def cell(self) -> str:
        """A table cell: the median ± half the :attr:`spread`, ``1.102 ±2.1%``; when :attr:`noisy`,
        ``noisy ±73.4%`` (``noisy`` alone with too few rounds)."""
        if len(self.samples) < MIN_ROUNDS:
            return "noisy"
        return f"{'noisy' if self.noisy else f'{self.median:.3f}'} ±{self.spread / 2:.1%}"


def ratio(numerator: Timing, denominator: Timing) -> Ratio:
    """Round-by-round ratio of two contenders timed together by :func:`interleaved`."""
    return Ratio(tuple(a / b for a, b in zip(numerator.samples, denominator.samples, strict=True)))


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    on_round=None,
    *,
    measured: bool = False,
) -> dict[str, Timing]:
    """Run every function once per round, ``warmup`` untimed rounds then ``repeats`` timed
    ones, rotating the order each round; returns each function's timings (sample ``i`` of
    every function from timed round ``i``). ``measured=True``: each function returns the
    seconds to record, its own measure of the part that is compared (say, decoding steps
    without the prefill), instead of its wall time."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for r in range(warmup + repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                _sync()
                t0 = time.perf_counter()
                out = fns[name]()
                _sync()  # CUDA runs asynchronously: time the work, not the launch
                dt = float(out) if measured else time.perf_counter() - t0
                if r >= warmup:
                    samples[name].append(dt)
            if on_round is not None:
                on_round()
    return {n: Timing(tuple(s)) for n, s in samples.items()}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
