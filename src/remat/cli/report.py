"""`remat report`: one self-contained HTML page from profile, plan and verification JSON files."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from remat.cli._app import app, console


@app.command()
def report(
    files: list[Path] = typer.Argument(
        ..., help="profile.json, then any plan.json and verification.json (kind read from each file's \"format\")."
    ),
    output: Path = typer.Option(Path("report.html"), "--output", "-o", help="Where to write the HTML page."),
    budget: str | None = typer.Option(
        None, "--budget", "-b", help="Memory budget to judge the plans by, e.g. 4GiB or 80% (of the measured peak); "
        "default: the tightest budget the plans were made for."
    ),
    figures_dir: Path | None = typer.Option(
        None, "--figures-dir", help="Also write each plot as PNG and SVG into this folder."
    ),
) -> None:
    """Write the HTML report (summary, tables, plots, plan per block, environment) and print its path."""
    from remat.plan.budget import parse_budget
    from remat.report.html import write_report
    from remat.report.inputs import load_inputs

    inputs = load_inputs(files)
    budget_bytes = None if budget is None else parse_budget(budget, inputs.profile.peak_bytes)
    path = write_report(output, inputs.profile, inputs.plans, inputs.verifications,
                        commands=[_command_line(files, output, budget, figures_dir)], budget_bytes=budget_bytes, figures_dir=figures_dir)
    console.print(f"report: {path}", soft_wrap=True)


def _command_line(files: list[Path], output: Path, budget: str | None, figures_dir: Path | None) -> str:
    """The command that writes this report again."""
    args = ["remat", "report", *map(str, files), "-o", str(output)]
    if budget is not None:
        args += ["--budget", budget]
    if figures_dir is not None:
        args += ["--figures-dir", str(figures_dir)]
    return shlex.join(args)
