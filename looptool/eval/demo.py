"""The demo run: convert a source model, check that every budget reproduces it bit for bit,
generate a short greedy continuation at every budget, and (``timing=True``) time the budgets
side by side against it (``looptool demo``; :func:`run_demo` from Python)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from looptool.core.errors import LooptoolError
from looptool.core.plan import LoopPlan
from looptool.eval.timing import MIN_ROUNDS, RATIO_SPREAD_LIMIT, Ratio, Timing, ratio

log = logging.getLogger(__name__)

DEMO_TEXT = (
    "We the People of the United States, in Order to form a more perfect Union, establish "
    "Justice, insure domestic Tranquility, provide for the common defence, promote the general "
    "Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain and "
    "establish this Constitution for the United States of America."
)

DEMO_PROMPT = "The Constitution of the United States"
DEMO_NEW_TOKENS = 16  # tokens of the greedy continuation generated at every budget

# stage(text, total) -> a context manager around one step of the run, yielding advance()
Stage = Callable[[str, "int | None"], ContextManager[Callable[[], None]]]


@dataclass
class DemoResult:
    """What :func:`run_demo` measured. ``timings`` holds ``"source"`` and every budget, or
    nothing when the run was not timed (``repeats`` is then 0)."""

    model: object  # the looped model (a LoopedModel)
    exact: dict[int, bool]  # budget -> its logits equal the source model's, bit for bit
    timings: dict[str | int, Timing]
    tokens: int  # sequence length of the checked (and timed) forwards (batch 1)
    repeats: int
    continuations: dict[int, str] = field(default_factory=dict)  # budget -> its greedy continuation

    @property
    def timed(self) -> bool:
        """Whether the run timed the budgets (``run_demo(timing=True)``)."""
        return bool(self.timings)

    @property
    def all_exact(self) -> bool:
        return all(self.exact.values())

    def time_ratio(self, budget: int) -> Ratio:
        """``budget``'s time over the shallowest budget's, round by round."""
        return ratio(self.timings[budget], self.timings[self.model.budgets[0]])

    def ideal_ratio(self, budget: int) -> float:
        """``(L + k) / (L + k0)`` for the source's ``L`` layers and the shallowest budget ``k0``:
        :meth:`time_ratio` if time were proportional to layer executions."""
        layers = self.model.dims().num_layers
        return (layers + budget) / (layers + self.model.budgets[0])

    def ideal_caption(self) -> str:
        """The sentence under the table that explains its ``ideal`` column (:meth:`ideal_ratio`)."""
        layers, first = self.model.dims().num_layers, self.model.budgets[0]
        return (
            f"ideal: the ×time if time grew in proportion to the layers run: each budget's layers ÷ budget "
            f"{first}'s, ({layers} + budget) ÷ {layers + first}"
        )

    @property
    def source_ratio(self) -> Ratio:
        """The shallowest budget's time over the source model's, round by round."""
        return ratio(self.timings[self.model.budgets[0]], self.timings["source"])

    def timing_notes(self) -> list[str]:
        """What the timing says, one sentence each: how to read the ×time column (each
        budget's :meth:`time_ratio` as a :meth:`~looptool.eval.timing.Ratio.cell`); the source
        model's time; the shallowest budget's ratio to it, or that the rounds are too noisy to
        give one (:attr:`~looptool.eval.timing.Ratio.noisy`); which budgets' ×time is too noisy,
        if any; and then how to get ratios."""
        source, first = self.timings["source"], self.model.budgets[0]
        notes = [
            f"×time: each budget's time ÷ budget {first}'s in the same round, median over the rounds ± half their "
            f"spread; 'noisy' where the rounds spread more than {RATIO_SPREAD_LIMIT:.0%} of their median or are "
            f"fewer than {MIN_ROUNDS}",
            f"source model: {source.median * 1e3:.0f} ms median (rounds {source.min * 1e3:.0f}–"
            f"{source.max * 1e3:.0f} ms); batch 1, {self.tokens} tokens, {self.repeats} interleaved rounds",
        ]
        r = self.source_ratio
        if not r.noisy:
            notes.append(f"budget {first} ÷ source = {r.median:.3f} (rounds {r.min:.3f}–{r.max:.3f})")
        else:
            notes.append(
                f"budget {first} ÷ source: the timing is too noisy to give a ratio ({_why_noisy({'its': r})})."
            )
        noisy = {k: q for k in self.model.budgets[1:] if (q := self.time_ratio(k)).noisy}
        if noisy:
            whose = {("its" if len(noisy) == 1 else f"budget {k}'s"): q for k, q in noisy.items()}
            notes.append(
                f"×time of budget{'s' if len(noisy) > 1 else ''} {', '.join(map(str, noisy))}: the timing is too "
                f"noisy to give a ratio ({_why_noisy(whose)})."
            )
        if r.noisy or noisy:
            notes.append(
                f"for ratios, rerun with at least {MIN_ROUNDS} rounds."
                if self.repeats < MIN_ROUNDS
                else "for ratios, rerun with nothing else running on the machine."
            )
        return notes


def _why_noisy(ratios: dict[str, Ratio]) -> str:
    """Why the noisy ``ratios`` (keyed by whose they are: ``"its"``, ``"budget 6's"``) give no
    ratio: too few rounds, or how far the rounds of the widest-spread one disagree."""
    whose, worst = max(ratios.items(), key=lambda item: item[1].spread)
    rounds = len(worst.samples)
    if rounds < MIN_ROUNDS:
        return f"{rounds} round{'s' if rounds > 1 else ''}; a ratio needs at least {MIN_ROUNDS}"
    return (
        f"{whose} rounds gave {worst.min:.3f}–{worst.max:.3f}, a spread of {worst.spread:.1%} of their median, "
        f"over the {RATIO_SPREAD_LIMIT:.0%} a ratio allows"
    )


def _no_stage(text: str, total: int | None = None) -> ContextManager[Callable[[], None]]:
    return contextlib.nullcontext(lambda: None)


def demo_ids(tokenizer, model, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids: :data:`DEMO_TEXT` tokenized and repeated (token ids 0..63 without a tokenizer)."""
    if tokenizer is not None:
        ids = tokenizer(DEMO_TEXT, return_tensors="pt").input_ids
    else:
        ids = torch.arange(64).unsqueeze(0) % model.config.vocab_size
    reps = -(-tokens // ids.shape[1])
    return ids.repeat(1, reps)[:, :tokens]


def demo_continuations(model, tokenizer, new_tokens: int = DEMO_NEW_TOKENS) -> dict[int, str]:
    """Each budget's greedy continuation of :data:`DEMO_PROMPT` (``new_tokens`` tokens), the
    budgets decoding together in one batch, a row per budget, each row exactly at its own budget
    (the token ids, space-separated, without a tokenizer)."""
    budgets = list(model.budgets)
    device = next(model.parameters()).device
    if tokenizer is not None:
        prompt = tokenizer(DEMO_PROMPT, return_tensors="pt").input_ids
    else:
        prompt = demo_ids(None, model, 8)
    ids = prompt.repeat(len(budgets), 1).to(device)
    rows = model.generate(ids, budget=budgets if len(budgets) > 1 else budgets[0], max_new_tokens=new_tokens)
    new = rows[:, prompt.shape[1] :].cpu()
    if tokenizer is None:
        return {k: " ".join(map(str, row.tolist())) for k, row in zip(budgets, new)}
    return {k: tokenizer.decode(row, skip_special_tokens=True) for k, row in zip(budgets, new)}


def run_demo(
    plan: LoopPlan,
    source: str | os.PathLike = "smollm2",
    *,
    tokens: int = 128,
    timing: bool = False,
    repeats: int = 5,
    device: str = "auto",
    output: str | os.PathLike | None = None,
    stage: Stage | None = None,
    say: Callable[[str], None] = log.info,
) -> DemoResult:
    """Load ``source`` (default: SmolLM2-135M from PyPI), convert it with ``plan``, compare
    every budget's logits on ``tokens`` demo tokens with the source model's (``exact``), and
    generate :data:`DEMO_NEW_TOKENS` greedy tokens at every budget (``continuations``); with
    ``timing``, then time the source and every budget in ``repeats`` interleaved rounds (after
    one warm-up). ``output``: also save the looped model there. ``stage(text, total)`` wraps
    each step (the command line's progress display; the timing step's ``advance()`` is called
    once per round)."""
    from looptool.capture.sources import load_source
    from looptool.eval.timing import interleaved
    from looptool.runtime.convert import convert
    from looptool.runtime.devices import resolve_device

    for name, value in (("tokens", tokens), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LooptoolError(f"{name} must be a whole number of at least 1, got {value!r}.", parameter=name)
    stage = stage or _no_stage
    target = resolve_device(device)
    with stage(f"loading {source}", None):
        src = load_source(source, device=str(target), say=say)
    with stage("capturing graph and looping", None):
        model = convert(src.model, plan, tokenizer=src.tokenizer)
    ids = demo_ids(src.tokenizer, model, tokens).to(target)
    exact: dict[int, bool] = {}
    with stage("checking every budget against the source", None), torch.inference_mode():
        ref = src.model(input_ids=ids).logits
        for k in model.budgets:
            exact[k] = torch.equal(ref, model(ids, budget=k).logits)
    with stage(f"generating {DEMO_NEW_TOKENS} tokens at every budget, one batch", None):
        continuations = demo_continuations(model, src.tokenizer)
    timings: dict[str | int, Timing] = {}
    if timing:
        fns: dict[str | int, Callable[[], object]] = {"source": lambda: src.model(input_ids=ids)}
        fns.update({k: functools.partial(model, ids, budget=k) for k in model.budgets})
        with stage(f"timing {len(fns)} contenders × {repeats} rounds ({tokens} tokens)", repeats + 1) as advance:
            timings = interleaved(fns, repeats=repeats, warmup=1, on_round=advance)
    if output is not None:
        with stage(f"saving to {output}", None):
            model.save_pretrained(Path(output))
    return DemoResult(
        model=model,
        exact=exact,
        timings=timings,
        tokens=int(ids.shape[1]),
        repeats=repeats if timing else 0,
        continuations=continuations,
    )
