"""The benchmark figures README.md and tests/bench/README.md quote from a results file
(``tests/bench/results/*.json``, copied by hand) match that file, at the precision shown.

How. Each check finds one fragment of a doc, reads the numbers it shows in order, and
compares them with values computed from the JSON. A fragment is either a table row (the
table found by a piece of its header line, the row by its first cell, optionally only some
of its columns) or a prose template (the doc's literal text with ``{}`` for each figure,
any run of whitespace matching any other). A shown number matches when it lies within half
a unit of its last shown digit: "1.83×" matches 1.8312, "64%" matches 64.1, "2,805"
matches 2804.9, "10k" matches 10000, "3.1e-5" matches 3.147e-5, and both "0.408" and
"0.407" match an exact tie 0.4075 (also one stored in float32, as 0.40749999…). ``None``
marks a number in a fragment that is not a results-file figure (a setting of the script,
a paper's number, a threshold); ``Le``, ``Ge`` and ``Lt`` check the doc's "≤ x", "≥ x"
and "< x" claims; ``MB``/``MiB`` also check the unit the doc names. Every body row of a
mapped table must be claimed by a check, and every table of the two docs is either mapped
or listed in ``UNCHECKED_TABLES`` with its reason, so a new table or row fails here until
it is mapped. ``KNOWN_MISMATCHES`` holds the figures that disagree with their file and are
not yet resolved; they are expected to fail (strictly), so resolving one means removing it.

Covered (results file → tests/bench/README.md, unless README.md is named):

- bench_decode.json → the "Cached decoding speed" table, its settings and ratio prose;
  README.md's headline "cached decoding" row.
- bench_train.json → the training-throughput table, the ``--checkpoint`` table, the
  settings and "Reading" prose; README.md's "saved activations" and "mixed-depth training" rows.
- bench_quality.json → the validation-loss table, settings, one-loop tax, spread and
  training-throughput prose; README.md's "one-loop tax" and "deeper budgets" rows.
- bench_quality_gate_lr_5e-2.json, bench_quality_recipe.json → the "Gate LR 5e-2" and
  "retrofit recipe" paragraphs.
- bench_depth.json → the pointer-chasing table (hard-tier mean per budget, 3-hop accuracy
  shallowest → best, gain) and the prose under it; README.md's "pointer chasing" row.
- bench_addition.json → the "Addition probe" paragraph.
- posttrain_example.json → the post-training table and its settings and RL-reward prose.
- analyze_tiny_moe.json, analyze_smollm2.json → the two per-layer tables of "Mechanistic
  analysis" and the Hydra, logit-lens, gate, cosine and norm-ratio prose under them.
- load.json → the "Load and start-up" table and the targets prose under it; README.md's two
  load rows.
- bench_ort.json → the per-budget ONNX table, the targets table (its "target" column is
  not a measurement) and the prose under it; README.md's "ONNX decode" row.
- bench_peer.json → the arm table (ms per decode step) and the ratio table of "Decode speed
  against onnxruntime-genai", its PyTorch batch-8 ÷ batch-1 and held-out-loss prose;
  README.md's three onnxruntime-genai rows.
- bench_peer_memory.json → the resident-memory table of "Decode speed against
  onnxruntime-genai"; README.md's memory row.
- bench_serve_pytorch.json, bench_serve_onnx.json → the "Serving many streams" table and the
  prefix-cache table; README.md's serving and prefix-cache rows.
- bench_ray_serve.json → the "Scale-out on Ray Serve" table and prose (with bench_peer.json's
  batch-8 steps for the ceiling); README.md's two Ray rows.
- bench_ray_serve_elr.json → that section's ELR table and prose.
- bench_structured.json, bench_structured_batch4.json → the two "Structured outputs" tables
  and prose; README.md's structured-outputs row.
- bench_core.json → the "One engine core" table.
- bench_speculative.json → the "Self-speculative decoding" table.
- bench_auto.json → the "Per-token depth" table.
- bench_auto_depth.json → the "Per-token depth on pointer chasing" table and its target prose.
- bench_auto_depth_gate.json, bench_depth_gate.json → the "Learned exits on pointer chasing" table and its prose.
- bench_exit_gate.json → the "Learned exits on SmolLM2" table and its prose.
- bench_unused.json → the "No cost when unused" table and its mixed-batch prose.
- bench_auto_timing.json → the "Per-token depth" wall-clock table.
- bench_accuracy_level.json → the int4 accuracy-level table (decode speed and batch invariance)
  and its 1.39× prose.

Not checked, because no results file is kept for them (the docs say so):

- "Conversion cost" table (``bench_convert.py`` prints one JSON line);
- "Runtime overhead" table and its prose (``bench_budgets.py`` prints one JSON line);
- "TensorRT export without TensorRT" prose (``bench_trt_variants.py`` and ``looptool
  export`` print, nothing is stored);
- "Exactness" and "Independent references with trained parameters" (the test suite is
  the record); "On a GPU (not run yet)" (no numbers);
- README.md's headline rows for exactness, conversion and forward latency: the conversion
  and latency figures are compared with tests/bench/README.md's tables instead
  (``test_headline_figures_without_a_results_file_match_the_bench_readme``).

Figures in covered sections that the results files do not hold, so not checked: wall
times the scripts do not store (training throughput "about 24 min", depth "~20 min" and
"~35 min", the analyze runs' convert/train/analyze seconds); the quality run's 180.6 and
211.8 tokens/s (only their ratio is stored) and the gates' mean/max ``|tanh g|`` of the
quality and gate-LR runs; earlier runs the docs cite for comparison (training's "0.990",
"0.951", "+30%", "+15%"; ORT's separate
last-position A/B 281 → 234 / 358 → 318 ms and the earlier engines' 5.9×); the export's
"about 16 s" for assembling graphs; approximations ("~40% floor", "0.6× eager", "~15%",
"540 MB"); the load section's ``python -X importtime`` seconds (one profiled load, not
stored) and its other runs of the same change (1.88 / 2.00 / 2.11 s and 1.85 / 2.07 / 2.49 s;
not kept); the papers' numbers; settings the results files do not record (windows of the
addition and post-training runs, model shapes, token counts of the analyze training runs);
and settings that only appear in command lines.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "bench" / "results"
BENCH = "tests/bench/README.md"
README = "README.md"

# Tables that quote no results file, by a piece of their header line, with the reason.
UNCHECKED_TABLES = {
    BENCH: {
        "| section | script | results file |": "the index of sections and scripts (no figures)",
        "| what | min / median / max | ratio / target |": "conversion cost: bench_convert.py keeps no results file",
        "| path | min / median / max (ms) |": "runtime overhead: bench_budgets.py keeps no results file",
    },
    README: {
        "| extra | adds | needed for |": "install extras (no figures)",
        "| what | CPU | NVIDIA GPU | TensorRT |": "what ran where: test-suite counts, no results file",
    },
}
# Rows of mapped tables that quote no results file.
UNCHECKED_ROWS = {
    (README, "| what | measured | target | details |"): {
        "logits of every budget at conversion, 14 architectures + SmolLM2": "the test suite",
        "`looptool.convert` ÷ one plain `torch.export`": "bench_convert.py keeps no results file",
        "forward latency, prefix budget 0 ÷ source · ELR k=1 ÷ source": "bench_budgets.py keeps no results file",
    },
}


@functools.cache
def doc_text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


@functools.cache
def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- reading numbers
NUM = r"[+−-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:e[+−-]?[0-9]+)?k?"
_TOKEN = re.compile(rf"(?<![0-9A-Za-z_])(?:{NUM})(?![0-9A-Za-z_])")
_BYTE_UNIT = re.compile(r"(?<![A-Za-z])(GiB|MiB|KiB|GB|MB|kB)(?![A-Za-z])")
_BYTES = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "GB": 1e9, "MB": 1e6, "kB": 1e3}


@dataclass(frozen=True)
class Shown:
    """One number as a doc shows it: its text, value, half a unit of its last digit, and
    the first byte unit named after it in the same fragment (if any)."""

    text: str
    value: float | bool
    tol: float
    unit: str | None = None
    line: int = 0


def parse(token: str) -> tuple[float, float]:
    """(value, tolerance) of a shown number: "−1.5" → (-1.5, 0.05), "2,805" → (2805, 0.5),
    "10k" → (10000, 500), "3.1e-5" → (3.1e-5, 5e-7)."""
    s = token.replace("−", "-").replace(",", "").lstrip("+")
    scale = 1000 if s.endswith("k") else 1
    mantissa, _, exponent = s.rstrip("k").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(s.rstrip("k")) * scale, 0.5 * 10.0 ** ((int(exponent) if exponent else 0) - decimals) * scale


def numbers(text: str, line: int = 0) -> list[Shown]:
    """The numbers a fragment of Markdown shows, in order (bold and code marks ignored); a
    cell that is just "yes" or "no" shows a boolean."""
    text = text.replace("**", "").replace("`", "").replace("\\|", "|")
    if text.strip() in ("yes", "no"):
        return [Shown(text.strip(), text.strip() == "yes", 0.0, line=line)]
    out = []
    for m in _TOKEN.finditer(text):
        value, tol = parse(m.group(0))
        unit = _BYTE_UNIT.search(text, m.end())
        out.append(Shown(m.group(0), value, tol, unit.group(1) if unit else None, line))
    return out


@dataclass(frozen=True)
class Le:
    """The doc claims the value is ≤ the shown number (at the precision shown)."""

    value: float

    def holds(self, shown: Shown) -> bool:
        return self.value <= shown.value + shown.tol


@dataclass(frozen=True)
class Ge:
    """The doc claims the value is ≥ the shown number (at the precision shown)."""

    value: float

    def holds(self, shown: Shown) -> bool:
        return self.value >= shown.value - shown.tol


@dataclass(frozen=True)
class Lt:
    """The doc claims the value is < the shown number."""

    value: float

    def holds(self, shown: Shown) -> bool:
        return self.value < shown.value


@dataclass(frozen=True)
class Bytes:
    """A byte count the doc shows in ``unit``; the doc must name that unit after it."""

    count: float
    unit: str

    def holds(self, shown: Shown) -> bool:
        return shown.unit == self.unit and _close(shown, self.count / _BYTES[self.unit])


def MB(count: float) -> Bytes:
    return Bytes(count, "MB")


def MiB(count: float) -> Bytes:
    return Bytes(count, "MiB")


FLOAT32 = 2e-7  # relative: many stored values went through float32 (accuracies, losses)


def _close(shown: Shown, value: float) -> bool:
    """Within half a unit of the last shown digit, allowing for float32 storage of ties
    (bench_depth.json's 0.4085 = 817/2000 is stored as 0.40849999338…)."""
    return math.isfinite(value) and abs(shown.value - value) <= shown.tol + FLOAT32 * abs(value) + 1e-12


def mismatches(shown: list[Shown], expected: list, where: str = "", line: int = 0) -> list[str]:
    """Every shown number that its expected value does not match, as 'where:line: shows X,
    the results file gives Y'; a count mismatch is one problem."""
    if len(shown) != len(expected):
        return [
            f"{where}:{line}: shows {len(shown)} numbers ({', '.join(s.text for s in shown)}), "
            f"the check expects {len(expected)} ({', '.join(map(_fmt, expected))})"
        ]
    out = []
    for s, want in zip(shown, expected):
        if want is None:
            continue
        if isinstance(want, bool) or isinstance(s.value, bool):
            ok = s.value is want
        elif isinstance(want, (Le, Ge, Lt, Bytes)):
            ok = want.holds(s)
        else:
            ok = _close(s, float(want))
        if not ok:
            out.append(
                f"{where}:{s.line}: shows {s.text}{' ' + s.unit if s.unit else ''}, the results file gives {_fmt(want)}"
            )
    return out


def _fmt(value) -> str:
    if isinstance(value, Bytes):
        return f"{value.count / _BYTES[value.unit]!r} {value.unit}"
    return repr(value)


# --------------------------------------------------------------------------- finding fragments
@dataclass(frozen=True)
class Table:
    line: int  # of the header
    header: str
    rows: tuple[tuple[int, tuple[str, ...]], ...]  # (line, cells); rows[0] is the header


def _cells(line: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1]))


def tables(text: str) -> list[Table]:
    """Every Markdown table of a doc (a header line, a |---| line, body lines)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if (
            lines[i].startswith("|")
            and i + 1 < len(lines)
            and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())
        ):
            rows, j = [(i + 1, _cells(lines[i]))], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, _cells(lines[j])))
                j += 1
            out.append(Table(i + 1, lines[i], tuple(rows)))
            i = j
        else:
            i += 1
    return out


def find_table(text: str, key: str) -> Table:
    found = [t for t in tables(text) if key in t.header]
    assert len(found) == 1, f"{len(found)} tables have {key!r} in their header line"
    return found[0]


def template_regex(template: str) -> re.Pattern:
    """The doc's literal text with a capture group for each ``{}``; whitespace is flexible."""
    parts = []
    for i, literal in enumerate(template.split("{}")):
        if i:
            parts.append(f"({NUM})")
        parts += [r"\s+" if p.isspace() else re.escape(p) for p in re.split(r"(\s+)", literal) if p]
    return re.compile("".join(parts))


@dataclass(frozen=True)
class Check:
    """Figures of one doc fragment against the values a results file gives."""

    doc: str
    source: str  # the results file's stem
    expected: tuple
    table: str | None = None  # a piece of the table's header line
    label: str | None = None  # the row's first cell, exactly
    cols: tuple[int, ...] | None = None  # the columns read (all by default)
    template: str | None = None
    claim: bool = True  # a statement of the fragment that is not a number ("all identical")

    @property
    def name(self) -> str:
        what = f"{self.label}" if self.table else self.template
        return f"{self.doc} [{self.source}] {what}"

    def shown(self, text: str | None = None) -> tuple[int, list[Shown]]:
        text = doc_text(self.doc) if text is None else text
        if self.table is not None:
            table = find_table(text, self.table)
            rows = [(line, cells) for line, cells in table.rows if cells[0] == self.label]
            assert len(rows) == 1, f"{len(rows)} rows of the table at line {table.line} have the label {self.label!r}"
            line, cells = rows[0]
            cols = range(len(cells)) if self.cols is None else self.cols
            return line, [s for c in cols for s in numbers(cells[c], line)]
        found = list(template_regex(self.template).finditer(text))
        assert len(found) == 1, f"the text {self.template!r} occurs {len(found)} times"
        m = found[0]
        return text.count("\n", 0, m.start()) + 1, [
            Shown(s.text, s.value, s.tol, s.unit, text.count("\n", 0, m.start(g)) + 1)
            for g in range(1, m.re.groups + 1)
            for s in numbers(m.group(g) + text[m.end(g) : m.end()])[:1]
        ]

    def problems(self, text: str | None = None) -> list[str]:
        line, shown = self.shown(text)
        out = mismatches(shown, list(self.expected), self.doc, line)
        if not self.claim:
            out.append(f"{self.doc}:{line}: the fragment's statement does not hold for {self.source}.json")
        return out


def row(doc: str, table: str, label: str, *expected, source: str, cols=None, claim: bool = True) -> Check:
    return Check(doc, source, expected, table=table, label=label, cols=cols, claim=claim)


def prose(doc: str, template: str, *expected, source: str, claim: bool = True) -> Check:
    return Check(doc, source, expected, template=template, claim=claim)


def mmm(stats: dict) -> list[float]:
    return [stats["min"], stats["median"], stats["max"]]


# --------------------------------------------------------------------------- the mappings
def _decode():
    d = result("bench_decode")
    R = functools.partial(row, BENCH, "ms/token min / median / max", source="bench_decode")
    P = functools.partial(prose, BENCH, source="bench_decode")
    first, deepest = d["budgets"][0], d["budgets"][-1]
    yield R("transformers `generate` (source)", *mmm(d["hf_generate_ms_per_token"]))
    for b in d["budgets"]:
        yield R(
            f"budget {b['budget']}",
            b["budget"],
            *mmm(b["ms_per_token"]),
            b["ratio_to_budget_0"],
            b["ideal_layers"],
            b["ideal_flops"],
            b["kv_bytes_per_token"],
            b["kv_bytes_per_token_last_loop"],
        )
    yield R(
        f"budget {deepest['budget']}, last-loop KV",
        deepest["budget"],
        *mmm(d["deepest_last_loop_ms_per_token"]),
        d["deepest_last_loop_over_per_loop"],
    )
    yield P(
        "(batch {}, {}-token SOTU prompt, {} new tokens, greedy, {} interleaved rounds after a warm-up;",
        *(d[k] for k in ("batch", "prompt_tokens", "new_tokens", "rounds")),
    )
    yield P("Cached paths were built in {} s on first use.", d["cached_path_build_s"])
    yield P(
        "looptool budget {} ÷ transformers `generate` = **{}** (target ≤ 1.1)",
        first["budget"],
        d["budget_0_over_hf_generate"],
    )
    H = functools.partial(row, README, "| what | measured | target | details |", source="bench_decode", cols=(0, 1))
    yield H("cached decoding, budget 0 ÷ transformers `generate`", first["budget"], d["budget_0_over_hf_generate"])


def _train():
    t = result("bench_train")
    R = functools.partial(row, BENCH, "tokens/s min / median / max", source="bench_train")
    C = functools.partial(row, BENCH, "`--checkpoint`, deepest path", source="bench_train")
    P = functools.partial(prose, BENCH, source="bench_train")
    H = functools.partial(row, README, "| what | measured | target | details |", source="bench_train", cols=(0, 1))
    prefix, elr = t["schemes"]["prefix"], t["schemes"]["elr"]
    for scheme, name, budget in ((prefix, "prefix", "prefix budget {}"), (elr, "ELR", "ELR k={}")):
        yield R(f"plain ({name} run)", *mmm(scheme["plain_tokens_per_s"]))
        for i, (k, b) in enumerate(scheme["budgets"].items()):
            label, plan = budget.format(k), []
            if name == "ELR" and i == 0:
                plan = scheme["plan"]["recurrent"]
                label += f" ({plan[0]}:{plan[1]}, {scheme['plan']['update'].replace('-', ' ')})"
            yield R(
                label,
                int(k),
                *plan,
                *mmm(b["tokens_per_s"]),
                b["ratio_to_plain"],
                b["predicted"],
                b["measured_over_predicted"],
            )
        mixed = scheme["mixed"]
        rounds = [r["measured_over_predicted"] for r in mixed["rounds"]]
        yield R(
            f"{name} mixed (per round, realised draws)",
            *mmm(mixed["tokens_per_s"]),
            mixed["measured_over_predicted"],
            min(rounds),
            max(rounds),
        )
        m = scheme["memory_deepest"]
        yield C(
            budget.format(m["budget"]),
            m["budget"],
            MiB(m["plain"]["saved_activation_bytes"]),
            MiB(m["checkpoint"]["saved_activation_bytes"]),
            m["saved_bytes_ratio"],
            m["plain"]["step_s"]["median"],
            m["checkpoint"]["step_s"]["median"],
            100 * (m["time_ratio"] - 1),
        )
    yield P(
        "(SmolLM2-135M fp32, batch {} × {} tokens, {} optimizer steps per contender per round, {} timed rounds",
        *(t[k] for k in ("batch", "seq_len", "steps_per_round", "rounds")),
    )
    yield P(
        "mixed depth ran at {} (prefix) and {} (ELR) of the prediction",
        prefix["mixed"]["measured_over_predicted"],
        elr["mixed"]["measured_over_predicted"],
    )
    deeper = [b["measured_over_predicted"] for s in (prefix, elr) for b in list(s["budgets"].values())[1:]]
    yield P(
        "deeper paths train {}–{}% slower than their FLOPs predict", 100 * (1 - max(deeper)), 100 * (1 - min(deeper))
    )
    draws = {len(r["draws"]) for s in (prefix, elr) for r in s["mixed"]["rounds"]}
    yield P("Each round draws only {} budgets", draws.pop() if len(draws) == 1 else math.nan)
    yield P("Budget {} ÷ plain was {} here and 0.990 in a first run", 0, prefix["budgets"]["0"]["ratio_to_plain"])
    yield P("(ELR k={}: {} and 0.951)", 1, elr["budgets"]["1"]["ratio_to_plain"])
    yield P(
        "with the same {}× / {}× cut",
        prefix["memory_deepest"]["saved_bytes_ratio"],
        elr["memory_deepest"]["saved_bytes_ratio"],
    )
    yield H(
        "saved activations, plain → `--checkpoint` (prefix budget 12 · ELR k=4)",
        prefix["memory_deepest"]["budget"],
        elr["memory_deepest"]["budget"],
        prefix["memory_deepest"]["saved_bytes_ratio"],
        elr["memory_deepest"]["saved_bytes_ratio"],
    )
    yield H(
        "mixed-depth training ÷ FLOPs prediction (prefix · ELR)",
        prefix["mixed"]["measured_over_predicted"],
        elr["mixed"]["measured_over_predicted"],
    )


def _quality():
    q = result("bench_quality")
    R = functools.partial(row, BENCH, "val loss (nats/token)", source="bench_quality")
    P = functools.partial(prose, BENCH, source="bench_quality")
    H = functools.partial(row, README, "| what | measured | target | details |", source="bench_quality", cols=(0, 1))
    plain, s, mixed = q["plain_finetune_loss"], q["settings"], q["mixed"]
    losses = [m["loss"] for m in mixed]
    yield R("untrained source", q["source_loss"], q["source_loss"] - plain)
    yield R("plain fine-tune (b)", plain, plain - plain)
    for m in mixed:
        yield R(f"looped, budget {m['budget']}", m["budget"], m["loss"], m["delta_vs_plain"])
    yield P(
        "window 8:20, budgets {},{},{},{},{} sampled uniformly (no override), {} steps × {} × {} = {} tokens",
        *(m["budget"] for m in mixed),
        s["steps"],
        s["batch"],
        s["seq_len"],
        q["train_tokens"],
    )
    yield P("`python tests/bench/bench_quality.py --steps {}` → `results/bench_quality.json`", s["steps"])
    yield P("AdamW, weight LR {}, gate LR {}, layers 0–7 frozen; (b)", s["lr"], s["new_lr"])
    yield P("validation loss on the first {} tokens of the 2000–2021 addresses", q["eval_tokens"])
    yield P("(budget {} is within {} nats of plain fine-tuning", mixed[0]["budget"], mixed[0]["delta_vs_plain"])
    yield P("budgets {}–{} span {} nats", mixed[0]["budget"], mixed[-1]["budget"], max(losses) - min(losses))
    mean_budget, expected_ratio = q["expected"]["mean_budget"], q["expected_throughput_ratio"]
    layers = expected_ratio * mean_budget / (1 - expected_ratio)  # expected = L / (L + mean budget)
    yield P(
        "ratio **{}**, against {} / ({} + mean budget {}) = {} expected from the mean depth (realised mean budget {}, "
        "`p(budget {})` {} vs {} expected from ELR Eq. 3 over {} micro-batches)",
        q["throughput_mixed_over_plain"],
        layers,
        layers,
        mean_budget,
        expected_ratio,
        q["realised"]["mean_budget"],
        mixed[0]["budget"],
        q["realised"]["p_shallowest"],
        q["expected"]["p_shallowest"],
        q["realised"]["micro_batches"],
    )
    yield H(
        "one-loop tax: budget 0 after a 120-step retrofit vs plain fine-tuning",
        mixed[0]["budget"],
        s["steps"],
        mixed[0]["delta_vs_plain"],
    )
    yield H("deeper budgets after that retrofit", max(losses) - min(losses))

    g = result("bench_quality_gate_lr_5e-2")
    G = functools.partial(prose, BENCH, source="bench_quality_gate_lr_5e-2")
    deltas = [m["delta_vs_plain"] for m in g["mixed"]]
    yield G("**Gate LR {}.**", g["settings"]["new_lr"])
    yield G("--steps {} --new-lr {}` →", g["settings"]["steps"], g["settings"]["new_lr"])
    yield G("With {} tokens, letting the second passes write more hurts", g["train_tokens"])
    yield G(
        "budgets {} / {} / {} / {} / {} scored {} / {} / {} / {} / {}, that is {} … {} against the plain fine-tune. "
        "Budget {} also lost {} nats",
        *(m["budget"] for m in g["mixed"]),
        *(m["loss"] for m in g["mixed"]),
        min(deltas),
        max(deltas),
        g["mixed"][0]["budget"],
        g["mixed"][0]["delta_vs_plain"],
    )

    r = result("bench_quality_recipe")
    Q = functools.partial(prose, BENCH, source="bench_quality_recipe")
    rs, deltas = r["settings"], [m["delta_vs_plain"] for m in r["mixed"]]
    yield Q(
        "--steps {} --gate-floor {} --gate-floor-until {} --depth-curriculum {}` →",
        rs["steps"],
        rs["gate_floor"],
        rs["gate_floor_until"],
        rs["depth_curriculum"],
    )
    yield Q(
        "Holding the gates at ≥ {} for {} steps forced each second pass open (mean gates still ≈ {} after release)",
        rs["gate_floor"],
        rs["gate_floor_until"] * rs["steps"],
        r["mean_gate_min_tensor_after"],
    )
    yield Q(
        "budgets {} / {} / {} / {} / {} scored {} / {} / {} / {} / {}, {} … {} against the plain fine-tune — worse "
        "than the untrained source even at budget {},",
        *(m["budget"] for m in r["mixed"]),
        *(m["loss"] for m in r["mixed"]),
        min(deltas),
        max(deltas),
        r["mixed"][0]["budget"],
        claim=r["mixed"][0]["loss"] > r["source_loss"] and r["plain_finetune_loss"] == plain,
    )


HARD = ("3", "4", "5", "6")
# the depth table's rows → (arm, numbers its label shows: a function of the arm's JSON)
DEPTH_ROWS = {
    "plain continued (budget 0)": ("plain", lambda a: a["menu"]),
    "plain continued, 10k steps": ("plain-long", lambda a: [a["steps"]]),
    "untied iso-depth (layer 1 duplicated, 4 layers)": ("untied", lambda a: [None, None]),
    "prefix 1:3, menu 0,1": ("prefix", lambda a: [*a["plan"]["window"], *a["menu"]]),
    "ELR 1:2 exact init, k 1..3": ("elr-exact", lambda a: [*a["plan"]["recurrent"], a["menu"][0], a["menu"][-1]]),
    "ELR paper init": ("elr-paper", lambda a: []),
    "ELR from scratch (5000 steps)": ("scratch", lambda a: [a["steps"]]),
    "prefix + gate floor 0.5 (first half)": ("prefix-floor", lambda a: [a["recipe"]["gate_floor"]]),
    "prefix + depth curriculum (first half)": ("prefix-curriculum", lambda a: []),
    "ELR + gate floor 0.5": ("elr-floor", lambda a: [a["recipe"]["gate_floor"]]),
    "ELR + depth curriculum": ("elr-curriculum", lambda a: []),
    "ELR paper + `--exit-loss 1`": ("elr-exit", lambda a: [a["recipe"]["exit_loss"]]),
    "ELR exact + `--exit-loss 1`": ("elr-exact-exit", lambda a: [a["recipe"]["exit_loss"]]),
    "ELR paper, loop LR 5e-2 (10× split)": (
        "elr-lr",
        lambda a: [a["recipe"]["new_lr"], a["recipe"]["new_lr"] / result("bench_depth")["settings"]["new_lr"]],
    ),
    "**ELR paper, 10k steps**": ("elr-long", lambda a: [a["steps"]]),
    "ELR paper, 10k, exit loss + curriculum": ("elr-all-long", lambda a: [a["steps"]]),
}
# rows whose "3 hops, shallowest → best" cell is filled; rows showing only the first and last budget
DEPTH_THREE_HOPS = {"elr-paper", "elr-exit", "elr-lr", "elr-long", "elr-all-long"}
DEPTH_ENDS_ONLY = {"scratch"}


def hard(acc: dict) -> float:
    """Mean accuracy over the hard tiers (3–6 hops), as bench_depth.py's hard_mean."""
    return sum(acc[t]["acc"] for t in HARD) / len(HARD)


def _depth():
    d = result("bench_depth")
    R = functools.partial(row, BENCH, "budgets → hard-tier accuracy", source="bench_depth")
    P = functools.partial(prose, BENCH, source="bench_depth")
    arms, verdict, s = d["arms"], d["verdict"], d["settings"]
    yield R("base (no retrofit)", hard(d["base"]["accuracy"]), d["base"]["accuracy"]["3"]["acc"])
    for label, (arm, label_numbers) in DEPTH_ROWS.items():
        a = arms[arm]
        acc = a["accuracy"]
        budgets = sorted(acc, key=int)
        if arm in ("plain", "plain-long", "untied"):  # one budget trained and shown
            yield R(label, *label_numbers(a), hard(acc[budgets[0]]), acc[budgets[0]]["3"]["acc"])
            continue
        shown = [budgets[0], budgets[-1]] if arm in DEPTH_ENDS_ONLY else budgets
        per_budget = [x for b in shown for x in (int(b), hard(acc[b]))]
        three = (
            [acc[budgets[0]]["3"]["acc"], max(acc[b]["3"]["acc"] for b in budgets)] if arm in DEPTH_THREE_HOPS else []
        )
        means = [hard(acc[b]) for b in budgets]
        gain = verdict[arm]["gain_points"] if arm in verdict else 100 * (max(means) - means[0])
        yield R(label, *label_numbers(a), *per_budget, *three, gain)

    long, plain_long, untied = arms["elr-long"]["accuracy"], arms["plain-long"]["accuracy"]["0"], arms["untied"]
    base = d["base"]
    yield P(
        "Base: 3-layer d=64 Llama, {} steps of normal training with a hop curriculum ({} min); {} test questions per "
        "hop count (SE ≈ {} points). Every arm: {} steps (the `-long` arms {}), batch {}, LR {}, new-parameter LR {}.",
        base["steps"],
        base["seconds"] / 60,
        s["test_per_tier"],
        100 * base["accuracy"]["3"]["se"],
        s["steps"],
        arms["elr-long"]["steps"],
        s["batch"],
        s["lr"],
        s["new_lr"],
    )
    yield P("training; the best arm gains {}).", max(v["gain_points"] for v in verdict.values() if isinstance(v, dict)))
    yield P(
        "trained for {} steps answers **3-hop questions {}% of the time at k={} against {}% at k={}** ({} SE)",
        arms["elr-long"]["steps"],
        100 * long["2"]["3"]["acc"],
        2,
        100 * long["1"]["3"]["acc"],
        1,
        (long["2"]["3"]["acc"] - long["1"]["3"]["acc"]) / long["1"]["3"]["se"],  # in SEs of one accuracy (2.2 points)
    )
    yield P(
        "for the same {} steps stays at {}% and the untied 4-layer control ({} steps) at {}%.",
        arms["plain-long"]["steps"],
        100 * plain_long["3"]["acc"],
        untied["steps"],
        100 * untied["accuracy"]["0"]["3"]["acc"],
    )
    yield P("k={} and {} hold it ({}%)", 3, 4, 100 * long["3"]["3"]["acc"])
    yield P("k=3 and {} hold it ({}%)", 4, 100 * long["4"]["3"]["acc"])
    yield P("the 1-loop path stays within {} points of plain training", 100 * (hard(plain_long) - hard(long["1"])))
    # "the gate floor, the depth curriculum, the exit loss and the LR split each move the hard tiers by < 2 points"
    recipes = [
        k for k, a in arms.items() if {"gate_floor", "depth_curriculum", "exit_loss", "new_lr"} & set(a["recipe"])
    ]
    short = [verdict[k]["gain_points"] for k in recipes if arms[k]["steps"] == s["steps"]]
    yield P("move the hard tiers by < {} points at {} steps", Lt(max(short)), s["steps"])
    yield P(
        "made it worse on 3 hops ({}%)",
        100 * max(a["3"]["acc"] for a in arms["elr-all-long"]["accuracy"].values()),
    )
    H = functools.partial(row, README, "| what | measured | target | details |", source="bench_depth", cols=(0, 1))
    yield H(
        "pointer chasing, 3 hops: ELR k=2 vs k=1 (10k steps, 3-layer d=64 Llama)",
        3,
        2,
        1,
        arms["elr-long"]["steps"],
        None,
        None,
        100 * long["2"]["3"]["acc"],
        100 * long["1"]["3"]["acc"],
    )


def _addition():
    a = result("bench_addition")
    s, mixed = a["settings"], a["mixed"]
    P = functools.partial(prose, BENCH, source="bench_addition")
    errors = [100 * m["stderr"] for m in mixed]
    yield P(
        "{} steps × {} tokens of `a+b=c` lines, weight LR {}, gate LR {}, layers 0–7 frozen, {} held-out problems",
        s["steps"],
        s["seq_len"] * s["batch"],
        s["lr"],
        s["new_lr"],
        a["test_problems"],
    )
    yield P(
        "shared with other jobs, {} min): untrained source {} %, plain fine-tune {} %, mixed-depth budgets "
        "{}/{}/{}/{}/{}: {} / {} / {} / {} / {} % (± {}–{} stderr)",
        a["wall_s"] / 60,
        100 * a["source_accuracy"],
        100 * a["plain_finetune_accuracy"],
        *(m["budget"] for m in mixed),
        *(100 * m["accuracy"] for m in mixed),
        min(errors),
        max(errors),
    )


POSTTRAIN_ROWS = {
    "converted": ("converted", []),
    "chat SFT": ("sft", []),
    "RL expert: addition": ("expert_add", []),
    "RL expert: capitals": ("expert_caps", []),
    "merged (λ = 1)": ("merged", [None]),  # λ is the example's setting, not stored
    "distilled": ("distilled", []),
}


def _posttrain():
    p = result("posttrain_example")
    R = functools.partial(row, BENCH, "k=0 add", source="posttrain_example")
    P = functools.partial(prose, BENCH, source="posttrain_example")
    acc, s = p["accuracy"], p["settings"]
    budgets = list(acc["converted"])
    yield R("stage", *(int(b) for b in budgets for _ in ("add", "caps")))
    for label, (stage, label_numbers) in POSTTRAIN_ROWS.items():
        yield R(label, *label_numbers, *(acc[stage][b][task] for b in budgets for task in ("add", "caps")))
    yield P("(2-core CPU shared with two other benchmarks, {} min)", p["seconds"] / 60)
    yield P(
        "budgets {}, {}, {}; chat SFT ({} steps × 4 conversations",
        *map(int, budgets),
        s["steps_sft"],
    )
    yield P("one GRPO expert per task ({} steps × 6 prompts × 4 rollouts", s["steps_rl"])
    yield P("and {} steps of budget-matched two-teacher distillation", s["steps_distill"])
    yield P("Greedy accuracy on {} held-out prompts per task", s["test"])
    yield P("the RL reward per budget over {} steps is noise", s["steps_rl"])
    reward = p["rl_reward"]
    yield P(
        "(first vs last quarter: addition k={} {} → {}, k={} {} → {}, k={} {} → {}; capitals k={} {} → {}, "
        "k={} {} → {}, k={} {} → {})",
        *(
            x
            for task in ("add", "caps")
            for b in budgets
            for x in (int(b), reward[task][b]["reward_first"], reward[task][b]["reward_last"])
        ),
    )


def _writes(repeat: dict, branch: str) -> list[float]:
    w = repeat["writes"][branch]
    return [w["norm_ratio"], w["cosine"], w["gated_norm_ratio"], w["gate_mean_abs"]]


def _analyze_common(a: dict) -> tuple[dict, dict]:
    """(single delta by layer, logit-lens application loss by (budget, layer, execution))."""
    single = {r["layers"][0]: r["delta"] for r in a["hydra"]["single"]}
    lens = {(x["budget"], y["layer"], y["execution"]): y["loss"] for x in a["logit_lens"] for y in x["applications"]}
    return single, lens


def _tiny_moe():
    a = result("analyze_tiny_moe")
    R = functools.partial(row, BENCH, "experts kept", source="analyze_tiny_moe")
    P = functools.partial(prose, BENCH, source="analyze_tiny_moe")
    single, lens = _analyze_common(a)
    repeats, hydra, plan = a["repeats"], a["hydra"], a["plan"]
    for r in repeats:
        yield R(
            str(r["layer"]),
            r["layer"],
            r["experts"]["kept_mean"],
            r["experts"]["top_k"],
            *_writes(r, "attention"),
            *_writes(r, "moe"),
            r["residual_cosine"]["first_pass"],
            r["residual_cosine"]["second_pass"],
            single[r["layer"]],
        )
    yield P("8 experts, top-{}, byte tokenizer", repeats[0]["experts"]["top_k"])
    yield P("window {}:{}, budgets {}/{}/{}, trained", *plan["window"], *plan["budgets"])
    yield P("analysed on {} tokens of `tests/data/sotu/2*.txt` → `results/analyze_tiny_moe.json`", a["tokens"])
    yield P(
        "Hydra, adjacent pairs: {} ({}+{}), {} ({}+{}), {} ({}+{}) of the summed single effects",
        *(x for p in hydra["adjacent_pairs"] for x in (p["ratio"], *p["layers"])),
    )
    yield P("no spaced triplet fits {} repeated layers", len(repeats) if not hydra["spaced_triplets"] else math.nan)
    budgets = [x["budget"] for x in a["logit_lens"]]
    last = max(y["layer"] for y in a["logit_lens"][0]["applications"])
    yield P(
        "Logit lens: {} after layer {}, {} at the output, the same at every budget ({} / {} / {})",
        lens[(a["budget"], 0, 1)],
        0,
        lens[(a["budget"], last, 1)],
        *(x["loss"] for x in a["logit_lens"]),
        claim=len({round(lens[(b, 0, 1)], 6) for b in budgets}) == 1  # the same after layer 0 and at the output
        and len({round(x["loss"], 2) for x in a["logit_lens"]}) == 1,
    )
    gates = [w["gate_mean_abs"] for r in repeats for w in r["writes"].values()]
    yield P("still small (mean |tanh g| {}–{})", min(gates), max(gates))
    yield P("(residual cosine {} across every second pass)", min(r["residual_cosine"]["second_pass"] for r in repeats))
    kept = [r["experts"]["kept_mean"] for r in repeats]
    yield P("it keeps {}–{} of its {} experts", min(kept), max(kept), repeats[0]["experts"]["top_k"])
    cosines = [w["cosine"] for r in repeats for w in r["writes"].values()]
    yield P("writes nearly the same vector (cosine {}–{})", min(cosines), max(cosines))
    deltas = [abs(x["delta"]) for x in hydra["single"] + hydra["adjacent_pairs"]]
    yield P("The Hydra deltas are ≤ {} nats", Le(max(deltas)))


HYDRA_MIN_EFFECT = 5e-4  # the doc's "where the summed single effects are at least 5e-4 nats"


def _smollm2():
    a = result("analyze_smollm2")
    R = functools.partial(row, BENCH, "| layer | attention", source="analyze_smollm2")
    P = functools.partial(prose, BENCH, source="analyze_smollm2")
    single, lens = _analyze_common(a)
    repeats, hydra, plan, budget = a["repeats"], a["hydra"], a["plan"], a["budget"]
    for r in repeats:
        yield R(
            str(r["layer"]),
            r["layer"],
            *_writes(r, "attention"),
            *_writes(r, "mlp"),
            r["residual_cosine"]["first_pass"],
            r["residual_cosine"]["second_pass"],
            single[r["layer"]],
        )
    yield P("window {}:{}, budgets {}/{}/{}/{}/{}, trained", *plan["window"], *plan["budgets"])
    yield P("analysed on {} tokens of `tests/data/sotu/2*.txt` → `results/analyze_smollm2.json`", a["tokens"])

    def meaningful(r):
        return r["ratio"] is not None and r["ratio"] > 0 and abs(r["sum_of_single"]) >= HYDRA_MIN_EFFECT

    pairs, triplets = hydra["adjacent_pairs"], hydra["spaced_triplets"]
    good_pairs = [r["ratio"] for r in pairs if meaningful(r)]
    good_triplets = [r["ratio"] for r in triplets if meaningful(r)]
    others = [r["ratio"] for r in pairs + triplets if not meaningful(r)]
    yield P("Hydra (budget {}, base loss {})", hydra["budget"], hydra["base_loss"])
    yield P(
        "removing adjacent pairs together costs {}–{} of them ({} of {} pairs; median {}) and spaced triplets "
        "(spacing {}) {}–{} ({} of {}); the other ratios ({}, {}, {})",
        min(good_pairs),
        max(good_pairs),
        len(good_pairs),
        len(pairs),
        statistics.median(good_pairs),
        hydra["spacing"],
        min(good_triplets),
        max(good_triplets),
        len(good_triplets),
        len(triplets),
        *others,
    )
    yield P("(removing them alone lowers it by up to {} nats)", -min(single.values()))
    gates = [w["gate_mean_abs"] for r in repeats for w in r["writes"].values()]
    yield P("the gates stayed small (mean |tanh g| {}–{})", min(gates), max(gates))
    yield P(
        "(residual cosine ≥ {} across every second pass; min {} across the window, all first passes)",
        Ge(min(r["residual_cosine"]["second_pass"] for r in repeats)),
        a["window_residual_cosine"]["min"],
    )
    cosines = [w["cosine"] for r in repeats for w in r["writes"].values()]
    yield P("direction (cosine {}–{})", min(cosines), max(cosines))
    ratios = sorted((w["norm_ratio"], r["layer"], b) for r in repeats for b, w in r["writes"].items())
    (outlier, outlier_layer, outlier_branch), rest = ratios[0], [x for x, _, _ in ratios[1:]]
    yield P(
        "raw size (‖w₂‖/‖w₁‖ {}–{}, layer {}'s MLP {})",
        min(rest),
        max(rest),
        outlier_layer,
        outlier,
        claim=outlier_branch == "mlp",
    )
    yield P(
        "Logit lens: the output loss is {} / {} / {} / {} / {} at budgets {} / {} / {} / {} / {}",
        *(x["loss"] for x in a["logit_lens"]),
        *(x["budget"] for x in a["logit_lens"]),
    )
    lo, hi = plan["window"]
    window = [v for (b, layer, _), v in lens.items() if b == budget and lo <= layer < hi]
    last = max(layer for b, layer, _ in lens if b == budget)
    yield P(
        "({} after layer {}, {}–{} through the window, falling to {} only over",
        lens[(budget, 0, 1)],
        0,
        min(window),
        max(window),
        lens[(budget, last, 1)],
    )
    moves = {r["layer"]: lens[(budget, r["layer"], 2)] - lens[(budget, r["layer"], 1)] for r in repeats}
    yield P(
        "(layer {}: {} → {} at ×2), later ones move it by at most ±{}",
        lo,
        lens[(budget, lo, 1)],
        lens[(budget, lo, 2)],
        Le(max(abs(v) for layer, v in moves.items() if layer >= lo + 4)),  # "layers 8–11 lower …, later ones"
        claim=all(moves[layer] < 0 for layer in range(lo, lo + 4)),
    )


def _ort():
    o = result("bench_ort")
    R = functools.partial(row, BENCH, "eager prefill ms", source="bench_ort")
    S = functools.partial(row, BENCH, "| what | measured | target |", source="bench_ort", cols=(0, 1))
    P = functools.partial(prose, BENCH, source="bench_ort")
    budgets = o["budgets"]
    for k, b in budgets.items():
        yield R(
            k,
            int(k),
            *mmm(b["eager"]["prefill_ms"]),
            *mmm(b["ort"]["prefill_ms"]),
            b["prefill_ort_over_eager"],
            *mmm(b["ort_prepacked"]["prefill_ms"]),
            b["prefill_prepacked_over_eager"],
            *mmm(b["eager"]["decode_ms_per_token"]),
            *mmm(b["ort"]["decode_ms_per_token"]),
            b["decode_ort_over_eager"],
            *mmm(b["ort_prepacked"]["decode_ms_per_token"]),
            b["decode_prepacked_over_eager"],
            b["tokens_identical"],  # "same 128 tokens": yes
        )

    def span(key):
        values = [b[key] for b in budgets.values()]
        return [min(values), max(values)]

    yield S(
        "ORT decode ms/token ÷ eager, every budget (prepacked)",
        *span("decode_ort_over_eager"),
        *span("decode_prepacked_over_eager"),
    )
    yield S(
        "ORT prefill ÷ eager, every budget (prepacked)",
        *span("prefill_ort_over_eager"),
        *span("prefill_prepacked_over_eager"),
    )
    (last_loop_key,) = [k for k in o if k.startswith("last_loop_tokens_identical_")]
    last_loop = o[last_loop_key]
    yield S(
        f"greedy tokens ORT = eager: {o['new_tokens']} tokens per-loop (both runtimes) at every budget; "
        f"{last_loop_key.rsplit('_', 1)[1]} tokens last-loop at budgets {min(last_loop, key=int)}–{max(last_loop, key=int)}",
        o["new_tokens"],
        int(last_loop_key.rsplit("_", 1)[1]),
        int(min(last_loop, key=int)),
        int(max(last_loop, key=int)),
        claim=all(b["tokens_identical"] for b in budgets.values()) and all(last_loop.values()),
    )
    diffs = [v for b in budgets.values() for policy in b["export_max_abs_diff"].values() for v in policy.values()]
    yield S(
        "export validation max \\|Δ\\| of next-token logits (logits ~36), every graph",
        None,  # the logits' magnitude, not stored
        min(diffs),
        max(diffs),
    )
    twice = o["decode_time_2x_tokens_ratio"]
    yield S(
        "ORT decode time for 256 ÷ 128 new tokens (budget 0 / budget 12, median of 3)",
        2 * o["new_tokens"],
        o["new_tokens"],
        *map(int, twice),
        o["rounds"],
        *(v["median"] for v in twice.values()),
    )
    kv = o["kv_bytes_over_cost_model"]
    kv_ratios = {v for b in kv.values() for p, v in b.items() if p in ("per-loop", "last-loop")}
    yield S(
        "KV bytes the runtime allocates ÷ the cost model's (per-loop: 1.0/1.1/1.2/1.3/1.4 × budget 0; last-loop 1×)",
        *(b["per-loop_over_budget0"] for b in kv.values()),
        int(next(iter(kv))),
        None,  # the last-loop cache is one budget 0's by construction
        kv_ratios.pop() if len(kv_ratios) == 1 else math.nan,  # "at every budget and policy"
    )
    disk = o["disk"]
    yield S(
        "disk: `weights.bin` 538.17 MB + 10 graphs, manifest, tokenizer 4.81 MB ÷ 538.12 MB of parameters",
        MB(disk["weights_bytes"]),
        o["export"]["graphs"],
        MB(disk["other_bytes"]),
        MB(disk["parameter_bytes"]),
        disk["ratio"],
    )
    rss = o["rss"]
    one, every = rss["one_session"], rss["all_sessions"]
    yield S(
        "RSS of a process holding all 5 sessions ÷ one holding 1 (908 / 837 MiB, after a short generation each)",
        len(budgets),
        None,  # "one holding 1"
        MiB(every["rss_mib"] * 2**20),
        MiB(one["rss_mib"] * 2**20),
        rss["ratio_process"],
    )
    yield S(
        "… the same for the increment above the process before any session (630 / 559 MiB)",
        MiB((every["rss_mib"] - every["before_sessions_mib"]) * 2**20),
        MiB((one["rss_mib"] - one["before_sessions_mib"]) * 2**20),
        rss["ratio_increment"],
    )
    e = o["export"]
    yield S(
        "export of all 10 graphs (5 budgets × 2 policies; 6 bodies exported once, 18.1 s) ÷ one "
        "`torch.onnx.export` of the source (82.6 s / 62.5 s), validation excluded",
        e["graphs"],
        len(budgets),
        e["graphs"] / len(budgets),
        e["bodies"],
        e["bodies_seconds"],
        e["seconds_without_validation"],
        e["source_export_seconds"],
        e["ratio_without_validation"],
    )
    yield S(
        "… with validation (25.7 s) included (108.3 s / 62.5 s)",
        e["validation_seconds"],
        e["seconds_with_validation"],
        e["source_export_seconds"],
        e["ratio_with_validation"],
    )
    ort_version = float(".".join(o["onnxruntime"].split(".")[:2]))
    yield P(
        "({} intra-op threads for both PyTorch and onnxruntime {} (CPU provider), batch {}, a {}-token prompt of SOTU "
        "text, {} greedy new tokens, per-loop caches; eager, ORT and ORT with `prepack=True` interleaved at every "
        "budget over {} rounds;",
        o["threads"],
        ort_version,
        o["batch"],
        o["prompt_tokens"],
        o["new_tokens"],
        o["rounds"],
    )
    b3 = budgets["3"]
    yield P(
        "(budget {}'s {} is eager noise: {}–{} ms)",
        3,
        b3["prefill_ort_over_eager"],
        b3["eager"]["prefill_ms"]["min"],
        b3["eager"]["prefill_ms"]["max"],
    )
    yield P("the {}–{} (not 2.0) is the fixed-capacity cache", *(v["median"] for v in twice.values()))
    missed = [int(k) for k, b in budgets.items() if b["prefill_ort_over_eager"] > 0.8]  # the target ≤ 0.8
    yield P("**The prefill target is missed** at budgets {}, {}, {} and {}", *missed)
    later = list(e["per_graph_seconds"].values())[2:]
    yield P(
        "Of the {} s export, {} s exported the {} distinct bodies",
        e["seconds_without_validation"],
        e["bodies_seconds"],
        e["bodies"],
    )
    yield P("({}–{} s each after the first two)", min(later), max(later))
    H = functools.partial(row, README, "| what | measured | target | details |", source="bench_ort", cols=(0, 1))
    yield H("ONNX decode ms/token ÷ eager, every budget", *span("decode_ort_over_eager"))


def _ms(t: dict) -> list[float]:
    return [t["min_ms"], t["median_ms"], t["max_ms"]]


def _peer():
    d = result("bench_peer")
    R = functools.partial(row, BENCH, "| arm (ms per decode step) |", source="bench_peer", cols=(0, 1, 2))
    Q = functools.partial(row, BENCH, "| ratio (round by round) |", source="bench_peer")
    P = functools.partial(prose, BENCH, source="bench_peer")
    arms: dict[str, dict[int, dict]] = {}
    for a in d["arms"].values():
        arms.setdefault(a["arm"], {})[a["batch"]] = a
    for name, by in arms.items():
        yield R(name, *_ms(by[1]["ms_per_step"]), *_ms(by[8]["ms_per_step"]))
    for r in d["ratios"]:
        label, b = r["ratio"], r["batches"]
        figures = [b["1"]["min"], b["1"]["median"], b["8"]["min"], b["8"]["median"]]
        if r["predicted"]:
            target = [None, r["predicted"]]  # "≤ 1.05 × (L + k) / L"
        elif label.endswith(("÷ genai_fp32", "÷ genai_int4")) and not label.startswith("genai"):
            target = [None, None]  # the targets at batch 1 and 8
        elif label.startswith(("rowwise", "torch")) or "÷ unrolled" in label:
            target = [None]  # "≤ 1.05"
        else:
            target = []
        if label.startswith("unrolled"):
            target = []  # the per-budget engine: a comparison, no target
        yield Q(label, *figures, *target)
    H = functools.partial(row, README, "| what | measured | target | details |", source="bench_peer", cols=(0, 1))
    by_label = {r["ratio"]: r["batches"] for r in d["ratios"]}
    for label, key in (
        (
            "ONNX decode, budget 0 ÷ onnxruntime-genai on the same weights (one row · eight rows)",
            "onnx_k0 ÷ genai_fp32",
        ),
        (
            "… the engine of a graph per budget, its defaults (no packing, no spinning)",
            "unrolled_k0 ÷ genai_fp32",
        ),
        (
            "int4 engine with int8 activations (genai's setting, not the default), budget 0 ÷ onnxruntime-genai int4 (one row · eight rows)",
            "onnx_int4_k0 ÷ genai_int4",
        ),
    ):
        shown_budget = [None] if "budget 0" in label else []  # the label's own "0"
        yield H(label, *shown_budget, by_label[key]["1"]["median"], by_label[key]["8"]["median"])
    torch1, torch8 = (arms["torch_k0"][b]["ms_per_step"]["min_ms"] for b in (1, 8))
    yield P("PyTorch's batch-8 step ÷ its batch-1 step: {} (minimums; target ≤ {}: missed)", torch8 / torch1, None)
    loss = d["loss"]
    yield P(
        "held-out loss (nats per token) on {} tokens of a State of the Union address after its first {} tokens: "
        "onnxruntime-genai int4 {}, looptool int4 {} ({} nats apart; target ≤ {}), both fp32 {} / {}",
        loss["tokens"],
        d["prompt_tokens"],
        loss["genai_int4"],
        loss["onnx_int4_k0"],
        abs(loss["onnx_int4_k0"] - loss["genai_int4"]),
        None,
        loss["genai_fp32"],
        loss["onnx_k0"],
    )


def _peer_memory():
    d = result("bench_peer_memory")
    R = functools.partial(row, BENCH, "| arm | sessions | resident MiB", source="bench_peer_memory")
    for name, a in d["arms"].items():
        ratios = [a["rss_vs_genai"], a["engine_vs_genai"]] if "rss_vs_genai" in a else []
        yield R(
            name,
            a["sessions"],
            a["rss_mib"]["median"],
            a["peak_mib"]["median"],
            a["imports_mib"],
            a["engine_mib"],
            *ratios,
        )
    H = functools.partial(
        row, README, "| what | measured | target | details |", source="bench_peer_memory", cols=(0, 1)
    )
    arms = d["arms"]
    yield H(
        "resident memory after opening the engine and decoding, ÷ onnxruntime-genai's (fp32 · int4; whole process · without the imports)",
        arms["looped"]["rss_vs_genai"],
        arms["looped_int4"]["rss_vs_genai"],
        arms["looped"]["engine_vs_genai"],
        arms["looped_int4"]["engine_vs_genai"],
    )


def _speculative():
    d = result("bench_speculative")
    names = {"prefix": "fixed-prefix", "elr": "ELR"}
    cols = tuple(range(1, 12))  # not the label, whose budgets and n are settings
    for model, r in d["models"].items():
        ms = r["ms_per_token"]
        for runtime, prefix in (("PyTorch", ""), ("onnxruntime", "onnx_")):
            for key, s in r["speculation"].items():
                if not key.startswith(f"{prefix}spec_n"):
                    continue
                n = s["draft_tokens"]
                yield row(
                    BENCH,
                    "| pair, drafts, runtime |",
                    f"{names[model]} {r['target']} ← {r['draft']}, n = {n}, {runtime}",
                    s["acceptance"],
                    s["tokens_per_verify"],
                    ms[f"{prefix}plain_k"]["median_ms"],
                    ms[f"{prefix}plain_j"]["median_ms"],
                    s["verify_ms"],
                    ms[key]["median_ms"],
                    s["predicted_speedup"],
                    s["measured_speedup"],
                    *s["measured_speedup_min_max"],
                    s["measured_over_predicted"],
                    source="bench_speculative",
                    cols=cols,
                )


def _speculative_headline():
    models = result("bench_speculative")["models"]
    yield row(
        README,
        "| what | measured | target | details |",
        "self-speculative decoding ÷ plain decoding at the target budget, SmolLM2 after 30 retrofit steps (ELR 4 ← 1 "
        "· fixed-prefix 12 ← 0)",
        *(max(s["measured_speedup"] for s in models[m]["speculation"].values()) for m in ("elr", "prefix")),
        source="bench_speculative",
        cols=(1,),
    )


def _auto():
    d = result("bench_auto")
    names = {"prefix": "fixed-prefix", "elr": "ELR"}
    R = functools.partial(row, BENCH, "| arm | mean depth | held-out NLL |", source="bench_auto", cols=(1, 2))
    for model, r in d["models"].items():
        for f in r["fixed"]:
            yield R(f"{names[model]}, budget {f['budget']}", f["budget"], f["loss"])
        for a in r["auto"]:
            t = "∞" if a["threshold"] == float("inf") else f"{a['threshold']:g}"
            yield R(f"{names[model]}, auto, threshold {t}", a["mean_depth"], a["loss"])


def _depth_rows(R, every: dict, hard: dict, shown: dict):
    """A pointer-chasing table's fixed budgets, the rules' ``shown`` thresholds and the oracle."""
    for f, h in zip(every["fixed"], hard["fixed"]):
        k = f["budget"]
        yield R(f"fixed, {k} loop{'s' if k > 1 else ''}", k, f["acc"], h["acc"])
    for rule, name in (("state", "state rule"), ("kl", "KL rule")):
        for a, h in zip(every.get(rule, ()), hard.get(rule, ())):
            if a["threshold"] in shown.get(rule, ()):
                yield R(f"auto, {name}, threshold {a['threshold']:g}", a["mean_depth"], a["acc"], h["acc"])
    oracle = (every["oracle"]["mean_depth"], every["oracle"]["acc"], hard["oracle"]["acc"])
    yield R("oracle (shallowest correct budget)", *oracle)


def _auto_depth():
    d = result("bench_auto_depth")
    every, hard = d["report"]["all"], d["report"]["hard"]
    R = functools.partial(
        row, BENCH, "| arm | mean loops | accuracy, tiers 1–6 |", source="bench_auto_depth", cols=(1, 2, 3)
    )
    yield from _depth_rows(R, every, hard, {"state": (0.3, 0.35, 0.4, 0.5, 0.6, 0.7), "kl": (0.1, 0.3, 1.0)})
    yield row(
        README,
        "| what | measured | target | details |",
        '`budget="auto"` on pointer chasing: mean loops to reach the best fixed budget\'s accuracy ÷ its loops',
        d["verdict"]["all"]["state"]["depth_ratio"],
        source="bench_auto_depth",
        cols=(1,),
    )
    P = functools.partial(prose, BENCH, source="bench_auto_depth")
    state = d["verdict"]["all"]["state"]
    yield P(
        "reaches the best fixed budget's accuracy at {} mean loops with the state rule ({}% of that budget's 2 loops",
        state["least_depth_reaching_best"],
        100 * state["depth_ratio"],
    )
    yield P(
        "(about ±{} on tiers 1–6; the worst point is {} under it)",
        2 * every["fixed"][0]["se"],
        -min(state["worst_margin"], d["verdict"]["all"]["kl"]["worst_margin"]),
    )


def _auto_depth_gate():
    d = result("bench_auto_depth_gate")
    every, hard = d["report"]["all"], d["report"]["hard"]
    R = functools.partial(
        row, BENCH, "| learned exits | mean loops |", source="bench_auto_depth_gate", cols=(1, 2, 3, 4)
    )
    for a, h in zip(every["gate"], hard["gate"]):
        if a["threshold"] in (0.3, 0.4, 0.5, 0.6, 0.7, 0.9):
            p = a["paired"]
            yield R(
                f"auto, learned exits, q {a['threshold']:g}", a["mean_depth"], a["acc"], h["acc"], p["margin"], p["se"]
            )
    yield from _depth_rows(R, every, hard, {"state": (0.5, 0.6, 0.7)})
    P = functools.partial(prose, BENCH, source="bench_auto_depth_gate")
    gate, state = d["verdict"]["all"]["gate"], d["verdict"]["all"]["state"]
    at = next(a for a in every["gate"] if a["threshold"] == 0.5)
    yield P("at {} loops they answer {} more", at["mean_depth"], at["paired"]["margin"])
    yield P("same mean depth, {} standard", gate["paired_between_1_and_2"]["best_margin_in_se"])
    yield P("(its best point there is {} paired standard", -state["paired_between_1_and_2"]["best_margin_in_se"])
    yield P(
        "reach {} at {} mean loops, {}% of its loops",
        gate["least_depth_reaching_best"] and d["verdict"]["all"]["best_fixed_acc"],
        gate["least_depth_reaching_best"],
        100 * gate["depth_ratio"],
    )
    yield P("the state rule reaches it at {} ({}%)", state["least_depth_reaching_best"], 100 * state["depth_ratio"])
    assert gate["paired_between_1_and_2"]["none_below"]
    yield row(
        README,
        "| what | measured | target | details |",
        '… with learned exits, on a model trained with them (`train --exit-gate`, `exit_rule="gate"`)',
        gate["depth_ratio"],
        source="bench_auto_depth_gate",
        cols=(1,),
    )
    arm = result("bench_depth_gate")["arms"]["elr-gate"]
    yield prose(BENCH, "then the arm, {} min", arm["train_seconds"] / 60, source="bench_depth_gate")
    yield prose(BENCH, "trained {} steps with `looptool train --exit-gate`", arm["steps"], source="bench_depth_gate")
    yield prose(BENCH, "then\n{} steps of `--exit-gate-only`", arm["fit_steps"], source="bench_depth_gate")


def _exit_gate():
    d = result("bench_exit_gate")
    R = functools.partial(row, BENCH, "| SmolLM2 exits | mean depth |", source="bench_exit_gate", cols=(1, 2, 3))
    for f in d["fixed"]:
        yield R(f"budget {f['budget']}", f["mean_depth"], f["loss"], f["forward_loss"])
    for a in d["auto_gate"]:
        if a["threshold"] in (0.4, 0.5, 0.7, 0.9, 1.0):
            yield R(f"auto, learned exits, q {a['threshold']:g}", a["mean_depth"], a["loss"])
    P = functools.partial(prose, BENCH, source="bench_exit_gate")
    fixed = {f["budget"]: f for f in d["fixed"]}
    yield P(
        "every budget is\nworse than budget 0 (by {} nats at 12", fixed[12]["forward_loss"] - fixed[0]["forward_loss"]
    )
    yield P("(budget 12: {} against {} exact", fixed[12]["loss"], fixed[12]["forward_loss"])
    yield P("`auto` is {} nats better than budget 12)", fixed[12]["loss"] - fixed[0]["loss"])
    yield P("the measured change of budget 0's loss is {})", d["verdict"]["one_loop_tax"])
    q4 = next(a for a in d["auto_gate"] if a["threshold"] == 0.4)
    yield P(
        "at q = 0.4 they spend {} repeated layers per token for a loss {}",
        q4["mean_depth"],
        fixed[0]["loss"] - q4["loss"],
    )
    yield P("gamma 0.005; {} min on one thread", d["fit_seconds"] / 60)
    assert d["verdict"]["target_met"] and not d["verdict"]["depth_pays"]


def _auto_timing():
    d = result("bench_auto_timing")
    names = {"prefix": "fixed-prefix", "elr": "ELR"}
    R = functools.partial(row, BENCH, "ms per decode step min / median / max", source="bench_auto_timing", cols=(1, 2))
    for model, arms in d["models"].items():
        for a in arms:
            if a["arm"] == "fixed":
                yield R(f"{names[model]}, budget {a['budget']}", a["budget"], *mmm(a["ms_per_step"]))
            else:
                t = "∞" if a["threshold"] == float("inf") else f"{a['threshold']:g}"
                label = f"{names[model]}, auto {t}, {a['path']}"
                yield R(label, a["mean_depth"], *mmm(a["ms_per_step"]))


def _unused():
    d = result("bench_unused")
    R = functools.partial(row, BENCH, "| arm | before, ms min / median / max |", source="bench_unused", cols=(1, 2, 3))
    for label, arm in (
        ("budget 0, one row", "shallowest"),
        ("budget 15, one row", "deepest"),
        ("budgets 0/15/0/15, four rows", "mixed x4"),
    ):
        s = d["arms"][arm]
        yield R(
            label,
            *(s[t][k] for t in ("baseline", "this") for k in ("min_ms", "median_ms", "max_ms")),
            s["ratio_of_medians"],
            s["ratio_of_mins"],
            s["median_round_ratio"],
        )
    mixed = d["arms"]["mixed x4"]
    yield prose(
        BENCH,
        "The mixed batch is within 3% by its minimums ({}) and by the median of the round-by-round ratios ({}), "
        "but its medians differ by {}%",
        mixed["ratio_of_mins"],
        mixed["median_round_ratio"],
        100 * (mixed["ratio_of_medians"] - 1),
        source="bench_unused",
    )
    yield prose(
        BENCH,
        "its round-by-round ratios run from {} to {} (those of the one-row budget-15 arm from {} to {})",
        min(mixed["round_ratios"]),
        max(mixed["round_ratios"]),
        min(d["arms"]["deepest"]["round_ratios"]),
        max(d["arms"]["deepest"]["round_ratios"]),
        source="bench_unused",
    )


def _accuracy_level():
    d = result("bench_accuracy_level")
    R = functools.partial(
        row, BENCH, "| int4 engine (ms per decode step) |", source="bench_accuracy_level", cols=(1, 2, 3, 4)
    )
    ms, same = d["decode_ms"], d["invariance"]
    for label, level in (
        ("accuracy level 1 (default: float activations)", "1"),
        ("accuracy level 4 (int8 activations)", "4"),
    ):
        yield R(
            label,
            *(ms[f"level{level}_batch{b}"][k] for b in (1, 8) for k in ("min_ms", "median_ms", "max_ms")),
            len(same[level]["differ"]),
            same[level]["prompts"],
            same[level]["max_logit_diff"],
        )
    ratio = d["ratio_level1_over_level4"]

    def cell(r: dict) -> list[float]:  # "median ±half the spread as a % of the median"
        return [r["median"], 100 * (r["max"] - r["min"]) / 2 / r["median"]]

    yield R("level 1 ÷ level 4 (round by round, median ± half the spread)", *cell(ratio["1"]), *cell(ratio["8"]))
    yield prose(
        BENCH,
        "**Float activations cost {}× per decode step** at batch 1 and at batch 8",
        ratio["1"]["median"],
        source="bench_accuracy_level",
    )


def _serve():
    for label, name in (
        ("PyTorch (looped model directory)", "bench_serve_pytorch"),
        ("onnxruntime (engine directory)", "bench_serve_onnx"),
    ):
        d = result(name)
        runs, ratios = d["runs"], d["ratios"]

        def median(get, runs=runs):
            return statistics.median(get(r) for r in runs)

        yield row(
            BENCH,
            "| runtime (server defaults, `--max-batch 8`) |",
            label,
            median(lambda r: r["single"]["output_throughput"]),
            median(lambda r: r["mixed"]["output_throughput"]),
            *(ratios["mixed_over_single_tok_s"][k] for k in ("min", "median")),
            median(lambda r: r["single"]["tpot_s"]["p50"]),
            median(lambda r: r["mixed"]["tpot_s"]["p50"]),
            *(ratios["tpot_capacity_4096_over_256"][k] for k in ("min", "median")),
            *(ratios["http_over_inproc_tok_s"][k] for k in ("min", "median")),
            source=name,
            cols=(0, 1, 2, 3, 4, 5, 6),
        )
    H = functools.partial(row, README, "| what | measured | target | details |", cols=(0, 1))
    yield H(
        "`looptool serve` with its defaults, eight streams ÷ one (onnxruntime · PyTorch)",
        result("bench_serve_onnx")["ratios"]["mixed_over_single_tok_s"]["median"],
        result("bench_serve_pytorch")["ratios"]["mixed_over_single_tok_s"]["median"],
        source="bench_serve_onnx",
    )


def _router_rows(header: str, name: str):
    """The rows of one router table of the Ray Serve section, from results file ``name``."""
    s = result(name)["summary"]
    R = functools.partial(row, BENCH, header, source=name)
    for label, arm in (
        ("depth-aware, defaults", "depth"),
        ("depth-aware, waits for its budget", "hold"),
        ("… and no riding", "strict"),
        ("Ray's router", "ray"),
    ):
        ratio = mmm(s["over_ray_tok_s"][arm]) if arm != "ray" else []
        yield R(
            label,
            s["tok_s"][arm]["median"],
            *ratio,
            *mmm(s["one_budget_share"][arm]),
            s["ttft_p50_s"][arm]["median"],
            s["tpot_p50_s"][arm]["median"],
        )


def _ray_serve():
    d = result("bench_ray_serve")
    s = d["summary"]
    yield from _router_rows("| router (2 replicas × 8 rows) |", "bench_ray_serve")
    P = functools.partial(prose, BENCH, source="bench_ray_serve")
    yield P("through the Ray\napplication {} tok/s", s["single_tok_s"]["ray"]["median"])
    yield P("`looptool serve --threads 1`\n{} tok/s", s["single_tok_s"]["single_process"]["median"])
    yield P("round by round: {} / {} / {} (min / median / max)", *mmm(s["single_ray_over_single_process"]))
    yield P("The defaults match Ray's router ({}×)", s["over_ray_tok_s"]["depth"]["median"])
    yield P("one-budget share to at most {} and costs", s["one_budget_share"]["strict"]["max"])
    yield P("throughput ({}× with no riding)", s["over_ray_tok_s"]["strict"]["median"])
    rows = statistics.median(
        r["strict"]["completed"]
        * d["settings"]["new"]
        / (r["strict"]["steps"]["one_budget"] + r["strict"]["steps"]["mixed"])
        for r in d["rounds"]
    )
    yield P("rows fall from 8 to about\n{} (tokens ÷ steps", rows)
    assert all(n == 0 for n in s["failed"].values())
    peer = result("bench_peer")["arms"]
    steps = [peer[f"b8/onnx_k{k}"]["ms_per_step"]["median_ms"] for k in d["menu"]]
    yield prose(
        BENCH, "batch-8 step takes {} ms at\nbudget 0 to {} ms at budget 12", steps[0], steps[-1], source="bench_peer"
    )
    yield prose(
        BENCH,
        "would take {} ms on average against {} for a mixed",
        statistics.fmean(steps),
        steps[-1],
        source="bench_peer",
    )
    yield prose(BENCH, "**at most {}× the throughput**", steps[-1] / statistics.fmean(steps), source="bench_peer")
    H = functools.partial(row, README, "| what | measured | target | details |", cols=(1,), source="bench_ray_serve")
    yield H(
        "Ray Serve, 2 replicas, mixed budgets: depth-aware router ÷ Ray's (tok/s · one-budget steps, defaults · waiting for the budget, no riding)",
        s["over_ray_tok_s"]["depth"]["median"],
        s["one_budget_share"]["depth"]["median"],
        s["over_ray_tok_s"]["strict"]["median"],
        s["one_budget_share"]["strict"]["median"],
    )
    yield H(
        "one stream through Ray Serve ÷ the single-process server (tok/s)",
        s["single_ray_over_single_process"]["median"],
    )


def _structured():
    runs = {b: result(f) for b, f in ((1, "bench_structured"), (4, "bench_structured_batch4"))}
    labels = {"free": "unconstrained", "masked": "masked", "jump": "forced tokens without a step"}
    for batch, d in runs.items():
        s, source = d["summary"], f"bench_structured{'' if batch == 1 else '_batch4'}"
        for arm, label in labels.items():
            ratio = [] if arm == "free" else mmm(s["ratios"][f"{arm}_over_free"])
            ms = [1000 * v for v in mmm(s["s_per_token"][arm])]
            yield row(
                BENCH,
                f"| arm (batch {batch}) |",
                label,
                *ms,
                *ratio,
                s["tokens"][arm],
                s["steps"][arm],
                s["forced"][arm],
                source=source,
            )
        assert s["valid"] and not d["errors"] and all(s["met"].values())
    one, four = runs[1]["summary"], runs[4]["summary"]
    P = functools.partial(prose, BENCH, source="bench_structured")
    masked = [100 * (r["summary"]["ratios"]["masked_over_free"]["median"] - 1) for r in runs.values()]
    yield P("the mask costs {}% per token at batch 1", masked[0])
    yield prose(BENCH, "({}% at batch 4)", masked[1], source="bench_structured_batch4")
    yield P("halves the cost per token at batch 1 ({}×)", one["ratios"]["jump_over_free"]["median"])
    yield prose(
        BENCH, "cuts it to {}× at batch 4", four["ratios"]["jump_over_free"]["median"], source="bench_structured_batch4"
    )
    cost = one["grammar_per_token_us"]
    yield P("without the model: {} µs to fill and apply", cost["mask_us"])
    yield P("guard), {} µs to accept a token, {} µs to ask", cost["accept_us"], cost["forced_us"])
    c = one["compile"]
    yield P(
        "takes\n{} s, compiling the schema {} ms, a compiled grammar found again {} µs",
        c["grammars_init_s"],
        1000 * c["compile_cold_s"],
        c["cache_hit_us"],
    )
    steps = [1000 * r["summary"]["s_per_step"][a]["median"] for r in runs.values() for a in ("jump", "free")]
    yield P("({} against {} ms at batch 1", *steps[:2])
    yield prose(BENCH, "{} against {} ms at batch 4", *steps[2:], source="bench_structured_batch4")
    yield P("({} tokens against `masked`'s {}", one["tokens"]["jump"], one["tokens"]["masked"])
    yield P(
        "{} s of decoding against\n{} s at batch 1",
        one["decode_s"]["jump"]["median"],
        one["decode_s"]["masked"]["median"],
    )
    yield row(
        README,
        "| what | measured | target | details |",
        "structured outputs, SmolLM2 onnxruntime, per output token ÷ unconstrained (batch 1 · 4): masked · with forced tokens",
        one["ratios"]["masked_over_free"]["median"],
        four["ratios"]["masked_over_free"]["median"],
        one["ratios"]["jump_over_free"]["median"],
        four["ratios"]["jump_over_free"]["median"],
        cols=(1,),
        source="bench_structured",
    )


def _ray_serve_elr():
    d = result("bench_ray_serve_elr")
    s = d["summary"]
    yield from _router_rows("| router (ELR, 2 replicas × 8 rows) |", "bench_ray_serve_elr")
    P = functools.partial(prose, BENCH, source="bench_ray_serve_elr")
    yield P("pays a little\n({} / {} / {} × Ray's router over the two rounds)", *mmm(s["over_ray_tok_s"]["strict"]))
    yield P("the defaults do not\n({}×)", s["over_ray_tok_s"]["depth"]["median"])
    yield P(
        "{} tok/s through Ray, {} through the single server",
        s["single_tok_s"]["ray"]["median"],
        s["single_tok_s"]["single_process"]["median"],
    )
    assert len(d["rounds"]) == 2 and d["menu"] == [1, 2, 3, 4] and all(n == 0 for n in s["failed"].values())


def _prefix_cache():
    H = functools.partial(row, README, "| what | measured | target | details |", cols=(0, 1))
    for label, name in (
        ("PyTorch (looped model directory)", "bench_serve_pytorch"),
        ("onnxruntime (engine directory)", "bench_serve_onnx"),
    ):
        d = result(name)
        runs, ratios = d["runs"], d["ratios"]
        yield row(
            BENCH,
            "| runtime | first request's TTFT (s) |",
            label,
            statistics.median(r["prefix"]["ttft_first_s"] for r in runs),
            statistics.median(r["prefix"]["ttft_second_s"] for r in runs),
            *(ratios["prefix_ttft_second_over_first"][k] for k in ("min", "median", "max")),
            *(ratios["prefix_ttft_deepest_after_budget_0"][k] for k in ("min", "median", "max")),
            source=name,
        )
    yield H(
        "prefix cache: time to first token of a request whose long prompt prefix is cached ÷ the first "
        "request's (onnxruntime · PyTorch)",
        result("bench_serve_onnx")["ratios"]["prefix_ttft_second_over_first"]["median"],
        result("bench_serve_pytorch")["ratios"]["prefix_ttft_second_over_first"]["median"],
        source="bench_serve_onnx",
    )


def _core():
    d = result("bench_core")
    R = functools.partial(row, BENCH, "| generate | before the core, ms", source="bench_core", cols=(1, 2, 3))
    for runtime, label in (("pytorch", "PyTorch"), ("onnxruntime", "onnxruntime")):
        for arm in ("budget 0, 1 row", "budget 12, 1 row", "budget 0, 8 rows"):
            s = d["arms"][f"{runtime}: {arm}"]
            yield R(
                f"{label}, {arm}",
                *(s[t][k] for t in ("baseline", "this") for k in ("min_ms", "median_ms", "max_ms")),
                s["ratio_of_medians"],
                s["ratio_of_mins"],
                s["median_round_ratio"],
            )


def _load():
    d = result("load")
    R = functools.partial(row, BENCH, "| what | min / median / max (s) |", source="load")
    P = functools.partial(prose, BENCH, source="load")
    L, G = d["load_s"], d["generate_s"]
    yield R("`looptool.load`, `LOOPTOOL_CACHE=off`", *mmm(L["off"]))
    yield R("`looptool.load`, warm disk cache, fresh process", *mmm(L["warm_disk"]))
    yield R("`looptool.load`, warm in-process cache (a second load)", *mmm(L["warm_memory"]))
    yield R("`import looptool`", *mmm(d["import_s"]))
    yield R(
        "`looptool generate --budget 0`, 16 tokens, first process (empty cache)", None, None, *mmm(G["first"])
    )  # settings
    yield R("the same, second process (the cache the first left)", *mmm(G["second"]))
    yield R("second ÷ first", *mmm(d["generate_ratio"]))
    yield P("`tests/bench/bench_load.py --rounds {}`", d["rounds"])
    yield P(
        "Targets: `generate` second ÷ first ≤ {} — met ({})",
        d["targets"]["generate_ratio"],
        d["generate_ratio"]["median"],
        claim=d["generate_ratio"]["median"] <= d["targets"]["generate_ratio"],
    )
    yield P(
        "Load from a warm cache ≤ {} s — met in\nprocess ({} s), **missed in a fresh process** ({} s median",
        d["targets"]["load_warm_disk_s"],
        L["warm_memory"]["median"],
        L["warm_disk"]["median"],
        claim=L["warm_memory"]["median"] <= 2 < L["warm_disk"]["median"],
    )
    H = functools.partial(row, README, "| what | measured | target | details |", source="load")
    yield H(
        "`looptool.load` from a warm cache: fresh process · in process",
        L["warm_disk"]["median"],
        L["warm_memory"]["median"],
        d["targets"]["load_warm_disk_s"],
    )
    yield H(
        "`looptool generate`, second call ÷ first (capture cache)",
        d["generate_ratio"]["median"],
        d["targets"]["generate_ratio"],
    )


def _gpu():
    """The H200 run of tests/gpu/run.sh: the training table and the kernel prose."""
    t = result("gpu_train_llama1b")["schemes"]["prefix"]
    R = functools.partial(
        row, BENCH, "| path | tokens/s | ÷ plain (median) | FLOPs prediction | MFU |", source="gpu_train_llama1b"
    )
    yield R("plain PyTorch fine-tuning", *mmm(t["plain_tokens_per_s"]), None, None, t["plain_mfu"])
    for k, b in t["budgets"].items():
        yield R(f"budget {k}", int(k), *mmm(b["tokens_per_s"]), b["ratio_to_plain"], b["predicted"], b["mfu"])
    yield R("mixed depth", *mmm(t["mixed"]["tokens_per_s"]), t["mixed"]["measured_over_predicted"])
    P = functools.partial(prose, BENCH, source="gpu_train_llama1b")
    m = t["memory_deepest"]
    yield P("Budget 0 runs at {} of plain fine-tuning", t["budgets"]["0"]["ratio_to_plain"])
    yield P(
        "deepest budget ({}) keeps {}× fewer\nsaved-activation bytes ({} GB → {} GB), lowers the peak over weights and "
        "optimizer state\n{}× ({} GB → {} GB) and costs {}× step time.",
        m["budget"],
        m["saved_bytes_ratio"],
        m["plain"]["saved_activation_bytes"] / 1e9,
        m["checkpoint"]["saved_activation_bytes"] / 1e9,
        m["peak_ratio"],
        m["plain"]["peak_bytes_over_weights_and_state"] / 1e9,
        m["checkpoint"]["peak_bytes_over_weights_and_state"] / 1e9,
        m["time_ratio"],
    )
    k = result("gpu_kernels")
    yield prose(
        BENCH,
        "copy bandwidth\n{} GB/s; `gated_residual` {} GB/s ({} of copy, target ≥ {}: **missed**),\n"
        "`adaptive_delta` {} GB/s ({}: **missed**), `modulate` {} GB/s; `moe` {} TFLOP/s\nagainst {} for a dense "
        "bf16 GEMM of the same FLOPs ({}, target ≥ {}: **missed**), {}×\nfaster than the unfused reference op.",
        k["copy_GBps"],
        k["gated_residual_GBps"],
        k["gated_residual_of_copy"],
        None,
        k["adaptive_update_GBps"],
        k["adaptive_update_of_copy"],
        k["modulate_GBps"],
        k["moe_TFLOPs"],
        k["dense_mm_TFLOPs"],
        k["moe_of_dense_mm"],
        None,
        k["moe_vs_reference_speedup"],
        source="gpu_kernels",
        claim=k["gated_residual_of_copy"] < 0.8 and k["adaptive_update_of_copy"] < 0.8 and k["moe_of_dense_mm"] < 0.5,
    )


# Figures that do not match their results file and that this change did not resolve (not a
# plain transcription error): each is reported, and must keep failing until it is resolved.
KNOWN_MISMATCHES: dict[str, Check] = {}  # none open: each entry is a figure that disagrees with its file


def _quality_wall() -> list[Check]:
    """The retrofit's total training time: the two training arms' wall_s."""
    return [
        prose(
            BENCH,
            "→ `results/bench_quality.json` ({} min of training in all)",
            sum(result("bench_quality")["wall_s"].values()) / 60,
            source="bench_quality",
        )
    ]


CHECKS = [
    *_decode(),
    *_train(),
    *_quality(),
    *_quality_wall(),
    *_depth(),
    *_addition(),
    *_posttrain(),
    *_tiny_moe(),
    *_smollm2(),
    *_ort(),
    *_load(),
    *_peer(),
    *_peer_memory(),
    *_serve(),
    *_ray_serve(),
    *_ray_serve_elr(),
    *_structured(),
    *_prefix_cache(),
    *_core(),
    *_speculative(),
    *_auto(),
    *_speculative_headline(),
    *_auto_depth(),
    *_auto_depth_gate(),
    *_exit_gate(),
    *_unused(),
    *_auto_timing(),
    *_accuracy_level(),
    *_gpu(),
]


# --------------------------------------------------------------------------- the tests
@pytest.mark.parametrize(
    "check",
    [*CHECKS, *(pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=k)) for k, c in KNOWN_MISMATCHES.items())],
    ids=lambda c: c.name[:100],
)
def test_doc_figures_match_the_results_file(check: Check):
    problems = check.problems()
    assert not problems, "\n".join(problems)


def test_every_table_is_mapped_or_has_no_results_file():
    """Each table of the two docs is mapped (every body row claimed) or listed unchecked."""
    claimed: dict[tuple[str, int], set[str]] = {}
    for c in CHECKS:
        if c.table is not None:
            claimed.setdefault((c.doc, find_table(doc_text(c.doc), c.table).line), set()).add(c.label)
    problems = []
    for name in (BENCH, README):
        for t in tables(doc_text(name)):
            unchecked = [k for k in UNCHECKED_TABLES[name] if k in t.header]
            if unchecked:
                continue
            if (name, t.line) not in claimed:
                problems.append(f"{name}:{t.line}: table {t.header[:60]!r} is neither mapped nor in UNCHECKED_TABLES")
                continue
            skip = next((rows for (d, key), rows in UNCHECKED_ROWS.items() if d == name and key in t.header), {})
            for line, cells in t.rows[1:]:
                if cells[0] not in claimed[(name, t.line)] and cells[0] not in skip:
                    problems.append(f"{name}:{line}: row {cells[0]!r} has no check")
    assert not problems, "\n".join(problems)


def test_every_results_file_is_quoted_and_checked():
    stems = {p.stem for p in RESULTS.glob("*.json")}
    assert stems == {c.source for c in CHECKS}, stems ^ {c.source for c in CHECKS}


def test_headline_figures_without_a_results_file_match_the_bench_readme():
    """README.md's conversion and forward-latency figures have no results file; they must
    at least be the ones tests/bench/README.md's tables show."""
    headline = find_table(doc_text(README), "| what | measured | target | details |")
    cell = {cells[0]: cells[1] for _, cells in headline.rows}
    convert = find_table(doc_text(BENCH), "| what | min / median / max | ratio / target |")
    overhead = find_table(doc_text(BENCH), "| path | min / median / max (ms) |")

    def first(table: Table, label: str, col: int) -> str:
        (cells,) = [c for _, c in table.rows if c[0] == label]
        return numbers(cells[col])[0].text

    assert [s.text for s in numbers(cell["`looptool.convert` ÷ one plain `torch.export`"])] == [
        first(convert, "SmolLM2 `looptool.convert` (capture + 5 budget paths)", 2)
    ]
    assert [s.text for s in numbers(cell["forward latency, prefix budget 0 ÷ source · ELR k=1 ÷ source"])] == [
        first(overhead, "prefix budget 0", 2),
        first(overhead, "ELR k=1 (8:22, adaptive delta)", 2),
    ]


def test_the_matcher_reads_the_precision_shown_and_catches_a_wrong_number():
    def ok(text, *expected):
        return not mismatches(numbers(text), list(expected))

    assert ok("**1.83×**", 1.8312) and ok("64%", 64.1) and ok("2,805", 2804.9) and ok("10k", 10000)
    assert (
        ok("−0.0002", -0.00018) and ok("3.1e-5 – 6.1e-5", 3.147e-5, 6.1035e-5) and ok("0.408 / 0.407", 0.4075, 0.4075)
    )
    assert ok("2,805 MiB", MiB(2941126660)) and ok("≥ 0.9997", Ge(0.99965)) and ok("yes", True)
    assert not ok("1.84×", 1.8312) and not ok("0.35", 0.3405) and not ok("+0.0002", -0.00018) and not ok("64%", 64.6)
    assert not ok("2,805 MB", MiB(2941126660)) and not ok("≤ 3e-4", Le(3.505e-4)) and not ok("no", True)
    assert not ok("1.83 / 1.83", 1.8312)  # a figure too many is caught, not skipped


def test_a_wrong_figure_in_the_docs_is_caught():
    """The same checks, fed the docs with one figure changed, fail and name it."""
    text = doc_text(BENCH)
    (decode_row,) = [c for c in CHECKS if c.table == "ms/token min / median / max" and c.label == "budget 3"]
    (decode_prose,) = [c for c in CHECKS if c.template and c.template.startswith("looptool budget {}")]
    assert not decode_row.problems(text) and not decode_prose.problems(text)
    wrong_row = text.replace("| 35.0 / 35.8 / 36.1 | 1.073 |", "| 35.0 / 35.8 / 36.1 | 1.074 |")
    wrong_prose = text.replace("= **1.045** (target", "= **1.054** (target")
    assert wrong_row != text and wrong_prose != text
    assert any("shows 1.074" in p for p in decode_row.problems(wrong_row))
    assert any("shows 1.054" in p for p in decode_prose.problems(wrong_prose))
