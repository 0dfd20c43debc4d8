"""Library errors as the command line says them.

Library errors name Python parameters (``seq_len``, ``overwrite=True``, ``kv='last-loop'``): a
Python caller has no flags. A command-line user typed ``--seq-len``, so :func:`cli_message`
rewrites an error for the running command (outside one, a library caller, nothing changes):

- every ``name=value`` fix the message spells becomes the option that sets it, as typed:
  ``overwrite=True`` → ``--overwrite``, ``conditioning=False`` → ``--no-conditioning``,
  ``kv='last-loop'`` → ``--kv last-loop``, ``dtype=torch.float32`` → ``--dtype float32`` (and
  "drop speculative" → "drop --speculative"). The
  option is the running command's, or, where the error's ``rerun`` names another command (an
  engine without an adaptive-depth graph: "export the engine again with adaptive='state' and
  kv='last-loop'"), that command's: each run of fixes becomes that command's line,
  ``looptool export MODEL_DIR --output OUTPUT --adaptive --kv last-loop``. A run of fixes some
  of which no option spells stays as it is, whole; so do the keyword arguments of a Python call
  the message quotes (``looptool.load(directory, dtype=...)``);
- :func:`option_hint` appends `` (option --seq-len)`` for the parameter the error names, unless
  the message already names that flag.
"""

from __future__ import annotations

import importlib
import re
import shlex

# Where the running command's context lives: typer >= 0.26 runs on its own vendored copy of
# click (whose context stack the click package never sees), older typer on click itself.
_CONTEXT_MODULES = ("typer._click.globals", "click.globals")

# library parameter -> the command-line parameter (the typer function's argument name, not the
# flag) that sets it, where the two names differ; a command matches either name
ALIASES = {
    "directory": "output",  # storage.files.check_output_dir / save(directory) <- every command's --output
    "teachers": "teacher",  # DistillConfig.teachers <- distill --teacher (repeatable)
    "budgets": "budget",  # export_onnx / export_tensorrt(budgets) <- export --budget
    "budget": "budgets",  # a budget of the menu train / rl / distill --budgets sample from
    "max_tokens": "tokens",  # eval.analyze.analyze(max_tokens) <- analyze --tokens
}

# library parameter -> the value its command-line flag (an on/off switch) stands for, besides True
FLAG_VALUES = {
    "adaptive": "state",  # export --adaptive writes the state rule's graph: export_onnx(adaptive=True) = 'state'
}

_QUOTED = r"'[^'\n]*'|\"[^\"\n]*\""
_VALUE = rf"{_QUOTED}|\[(?:\s*(?:{_QUOTED})\s*,?)*\]|[\w.:/+-]*\w"  # quoted, a list of quoted, or bare
_TORCH_DTYPE = r"torch\.(?:float32|float16|bfloat16)\b"
# a fix the message spells: name=value, then alternative values ("kv='per-loop', 'last-loop' or 'all'")
_SPELLING = re.compile(
    rf"(?<![\w.\-\[/])(?P<name>[a-z_][a-z0-9_]*)=(?P<value>{_VALUE})"
    rf"(?P<alternatives>(?:(?:, | or )(?:{_QUOTED}|{_TORCH_DTYPE}))*)"
)
_ALTERNATIVE = re.compile(rf"(?P<joint>, | or )(?P<value>{_QUOTED}|{_TORCH_DTYPE})")
_DTYPE = re.compile(rf"(?<![\w.]){_TORCH_DTYPE}")  # the command line names dtypes without the module
_CALL = re.compile(r"[\w.]+\([^()]*\)")  # a Python call quoted in the message: its arguments stay Python
_JOINT = re.compile(r",? and |, ")  # between two fixes of one run
_DROP = re.compile(r"(?<=\bdrop )[a-z_][a-z0-9_]*\b")  # "drop speculative": leave the parameter out


def current_context():
    """The context of the command being run (typer's or click's), or None outside one."""
    for module in _CONTEXT_MODULES:
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        if ctx is not None:
            return ctx
    return None


def _option(command, name: str):
    """``command``'s option (not argument) for the library parameter ``name``, or None."""
    wanted = {name, ALIASES.get(name, name)}
    for param in command.params:
        # duck-typed: click's and typer's vendored click's classes differ
        if param.name in wanted and getattr(param, "param_type_name", None) == "option":
            return param
    return None


def _long(flags) -> str | None:
    return max(flags, key=len) if flags else None


def _word(value: str) -> str:
    """One Python value as one command-line word: unquoted, a dtype without ``torch.``, shell-quoted."""
    if value[:1] in ("'", '"'):
        value = value[1:-1]
    return shlex.quote(value.removeprefix("torch."))


def _typed(param, name: str, value: str, alternatives: str) -> str | None:
    """``param`` set to the Python ``value`` (then ``alternatives``, "'a' or 'b'"), as typed on
    the command line; None where no flag spells it."""
    if getattr(param, "is_flag", False):
        if alternatives:
            return None
        if value == "True" or (value[:1] in ("'", '"') and value[1:-1] == FLAG_VALUES.get(name)):
            return _long(param.opts)
        return _long(getattr(param, "secondary_opts", None)) if value == "False" else None
    if value in ("True", "False", "None"):
        return None
    flag = _long(param.opts)
    if value.startswith("["):
        items = re.findall(_QUOTED, value)
        if not items or not getattr(param, "multiple", False):
            return None
        return " ".join(f"{flag} {_word(v)}" for v in items)
    rest = _ALTERNATIVE.sub(lambda m: m["joint"] + _word(m["value"]), alternatives)
    return f"{flag} {_word(value)}{rest}"


def _command_line(command) -> str:
    """``looptool COMMAND`` with its required arguments and options as placeholders."""
    words = ["looptool", command.name]
    for param in command.params:
        if param.required:
            placeholder = param.name.upper()
            words += [placeholder] if param.param_type_name == "argument" else [_long(param.opts), placeholder]
    return " ".join(words)


def _runs(text: str, calls: list[tuple[int, int]] | None = None) -> list[list[re.Match]]:
    """The fixes ``text`` spells outside its quoted Python calls (their spans, ``calls``, found
    here unless given), in runs joined by ', ' or ' and '."""
    if calls is None:
        calls = [m.span() for m in _CALL.finditer(text)]
    runs: list[list[re.Match]] = []
    for m in _SPELLING.finditer(text):
        if any(a <= m.start() < b for a, b in calls):
            continue
        if runs and _JOINT.fullmatch(text[runs[-1][-1].end() : m.start()]):
            runs[-1].append(m)
        else:
            runs.append([m])
    return runs


def _spell(text: str, ctx, rerun: str | None) -> str:
    """``text`` with its Python fixes spelled as the command line's (see the module docstring)."""
    running = ctx.command
    other = None
    if rerun and rerun != running.name:
        root = ctx.find_root().command
        other = getattr(root, "commands", {}).get(rerun)
    calls = [m.span() for m in _CALL.finditer(text)]
    edits: list[tuple[int, int, str]] = []
    for run in _runs(text, calls):
        if other is not None and any(_option(other, m["name"]) for m in run):
            typed = [
                _typed(p, m["name"], m["value"], m["alternatives"]) if (p := _option(other, m["name"])) else None
                for m in run
            ]
            if all(typed):
                edits.append((run[0].start(), run[-1].end(), " ".join([_command_line(other), *typed])))
            continue
        for m in run:
            param = _option(running, m["name"])
            typed_one = _typed(param, m["name"], m["value"], m["alternatives"]) if param else None
            if typed_one:
                edits.append((m.start(), m.end(), typed_one))
    for m in _DROP.finditer(text):
        if (param := _option(running, m.group())) is not None:
            edits.append((m.start(), m.end(), _long(param.opts)))
    for m in _DTYPE.finditer(text):
        if not any(a <= m.start() < b for a, b in [*calls, *((s, e) for s, e, _ in edits)]):
            edits.append((m.start(), m.end(), m.group().removeprefix("torch.")))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def option_hint(exc: BaseException, message: str | None = None) -> str:
    """`` (option --flag)`` for the current command's option that sets ``exc.parameter``;
    nothing where ``message`` (default: the error's) already names that flag."""
    name = getattr(exc, "parameter", None)
    ctx = current_context() if name else None
    param = _option(ctx.command, name) if ctx is not None else None
    if param is None:
        return ""
    text = str(exc) if message is None else message
    named = any(flag in text for flag in [*param.opts, *getattr(param, "secondary_opts", ())] if flag.startswith("--"))
    return "" if named else f" (option {_long(param.opts)})"


def cli_message(exc: BaseException) -> str:
    """``exc``'s message as the running command should print it: its ``name=value`` fixes as
    flags (or as the line of the command its ``rerun`` names), then :func:`option_hint`."""
    text = str(exc)
    ctx = current_context()
    if ctx is None:
        return text
    text = _spell(text, ctx, getattr(exc, "rerun", None))
    return text + option_hint(exc, text)
