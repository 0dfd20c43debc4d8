"""``looptool merge``: fine-tuned experts merged into a base model per parameter group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from looptool.cli.application import app, friendly, out
from looptool.cli.options import Overwrite
from looptool.cli.progress import progress
from looptool.core.errors import LooptoolError
from looptool.core.words import counted


@app.command(name="merge")
@friendly
def merge_cmd(
    base: Annotated[Path, typer.Argument(help="The base looped model directory.")],
    experts: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Expert looped model directories (same architecture and plan as BASE), numbered 0, 1, ... in this order.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Directory to write the merged model to.")
    ] = None,
    lambdas: Annotated[
        list[str] | None,
        typer.Option(
            "--lambda",
            "-l",
            help=(
                "Merge weight, repeatable: VALUE (every group, every expert), GROUP=VALUE (every expert) or "
                "EXPERT:GROUP=VALUE / EXPERT:VALUE (one expert); GROUP is a kind (embed_head, attention, mlp, router, norm, loop), a block "
                "(input, looped, output, loop) or BLOCK.KIND (looped.attention). The most specific group wins, then an "
                "expert's own spec, then the later spec; groups no spec matches keep the base (lambda 0)."
            ),
            show_default=False,
        ),
    ] = None,
    overwrite: Overwrite = False,
    list_groups: Annotated[
        bool, typer.Option("--list-groups", help="Print BASE's parameter groups with their sizes and exit.")
    ] = False,
) -> None:
    """Merge fine-tuned experts into BASE per parameter group (task arithmetic, Accordion post-training).

    Each group becomes theta = theta_base + sum_j lambda_j (theta_j - theta_base), computed in
    float32 and cast back to the model's dtype."""
    from looptool.posttrain.merge import (
        MERGE_CONFIG,
        group_sizes,
        merge,
        merge_config,
        merge_counts,
        parse_lambdas,
        save_merge,
    )
    from looptool.runtime.convert import load
    from looptool.storage.files import check_output_dir

    experts = list(experts or [])
    if list_groups:
        if experts or output is not None or lambdas:
            raise LooptoolError("--list-groups only reads BASE; drop the EXPERT paths, --output and --lambda.")
        with progress() as steps, steps.stage(f"rebuilding {base} on meta"):
            model = load(base, device="meta")
        table = Table(title=f"{base} · parameter groups", title_justify="left")
        for col, justify in (("family", "left"), ("group", "left"), ("tensors", "right"), ("parameters", "right")):
            table.add_column(col, justify=justify)
        for family, group, tensors, scalars in group_sizes(model):
            table.add_row(family, group, str(tensors), f"{scalars:,}")
        out.print(table)
        return
    if not experts:
        raise LooptoolError("give at least one EXPERT model directory after BASE.")
    if output is None:
        raise LooptoolError("pass --output/-o DIR: the directory to write the merged model to.")
    specs = parse_lambdas(list(lambdas or []), len(experts))  # fail before the slow loads
    check_output_dir(output, overwrite)
    with progress() as steps:
        with steps.stage(f"loading base {base}"):
            base_model = load(base)
        models = []
        for j, path in enumerate(experts):
            with steps.stage(f"loading expert {j} {path}"):
                models.append(load(path))
        with steps.stage(f"merging {len(models)} expert{'s' if len(models) != 1 else ''}"):
            merged = merge(base_model, models, specs, labels=[f"expert {j} ('{p}')" for j, p in enumerate(experts)])
        config = merge_config(base_model, specs, base_path=str(base), expert_paths=[str(p) for p in experts])
        with steps.stage(f"saving to {output}"):
            save_merge(merged, output, config, overwrite=overwrite)
    table = Table(title=f"{output} · {counted(len(experts), 'expert')} merged into {base}", title_justify="left")
    for col in ("group", "tensors", "parameters", *(f"λ {j}" for j in range(len(experts)))):
        table.add_column(col, justify="left" if col == "group" else "right")
    for family, group, tensors, scalars in group_sizes(base_model):
        if family == "block.kind":
            table.add_row(
                group, str(tensors), f"{scalars:,}", *(f"{lam:g}" for lam in config["lambda_by_group"][group])
            )
    out.print(table)
    changed, total = merge_counts(base_model, specs, len(experts))
    out.print(
        f"{changed} of {counted(total, 'tensor')} merged ({total - changed} kept from the base); "
        f"saved merged model to [bold]{output}[/] (experts and λ specs in {MERGE_CONFIG})"
    )
