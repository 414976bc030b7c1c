"""`remat run` (profile, plan, apply, verify, print) and `remat verify plan.json`."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat._units import format_bytes, in_unit, table_unit
from remat.apply.run import DEFAULT_OUT_DIR
from remat.distributed import is_main_process
from remat.cli._app import DEVICE_HELP, TARGET_HELP, app, check_output_dir, check_output_file, console, describe, fail, styled
from remat.cli.plan import TUNE_HELP, TUNE_SECONDS_HELP, TUNE_STEPS_HELP, print_tuning

RUN_OUT_DIR = DEFAULT_OUT_DIR / "run"
CAPTION = "The trade-off: a lower peak costs step time (forwards replayed in backward); gradients stay identical."



def _grad_cell(v) -> Text:
    if v.nonfinite:
        return styled(f"[bold red]NaN/Inf ({len(v.nonfinite)} tensors)[/]")
    if v.grads_identical:
        return styled("[green]identical[/]")
    if v.ok and v.relative_tolerance:
        return styled(f"[yellow]rel {v.grad_max_rel_diff:.1e} <= {v.relative_tolerance:.0e}[/]")
    if v.ok:
        return styled(f"[yellow]max diff {v.grad_max_abs_diff:.1e}[/]")
    return styled(f"[bold red]DIFFER {v.grad_max_abs_diff:.1e}[/]")


WIDE_COLUMNS = 130
"""Terminal width from which the table shows each prediction error and the replay check as columns."""
COMPACT_HEADERS = ("plan", "peak {unit}\npred/meas", "peak\nvs none", "step ms\npred/meas", "time vs none\npred/meas",
                   "gradients")
WIDE_HEADERS = ("plan", "peak {unit}\npredicted", "peak {unit}\nmeasured", "error", "peak\nvs none", "step ms\npredicted",
                "step ms\nmeasured", "overhead\npredicted", "overhead\nmeasured", "step\nerror", "replays\nas planned",
                "gradients")


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def verification_table(result, title: str, *, wide: bool | None = None) -> Table:
    """One row per plan: predicted vs measured peak and step time, both against no recomputation,
    gradient check. ``wide`` (default: a terminal of `WIDE_COLUMNS`) adds the errors and replay check."""
    wide = console.width >= WIDE_COLUMNS if wide is None else wide
    table = Table(title=title, caption=CAPTION, box=box.HEAVY_HEAD if wide else None, pad_edge=wide)
    unit, size = table_unit([b for r in result.rows
                             for b in (r.verification.predicted_peak_bytes, r.verification.measured_peak_bytes)])
    for header in WIDE_HEADERS if wide else COMPACT_HEADERS:
        # compact, a plan's name gives way where a slow step's wide times need the room (the
        # gradients' word was cut to 'identic…' instead)
        table.add_column(header.format(unit=unit), justify="left" if header in ("plan", "gradients") else "right",
                         no_wrap=header != "plan" if not wide else header == "plan")
    base = _baseline_measured_peak(result)
    # compact: one decimal, none from 100 units up, so that "pred/meas" stays narrow
    digits = 2 if wide else (1 if max((r.verification.measured_peak_bytes for r in result.rows), default=0) < 100 * size else 0)
    for row in result.rows:
        table.add_row(*(_wide_cells if wide else _compact_cells)(row, base, size, digits))
    return table


def _measured_peak(v, size: int, digits: int = 2) -> str | Text:
    """The measured peak in the table's unit of ``size`` bytes, red when over the plan's budget."""
    text = in_unit(v.measured_peak_bytes, size, digits)
    over = v.budget_bytes is not None and v.measured_peak_bytes > v.budget_bytes
    return styled(f"[red]{text} > budget {in_unit(v.budget_bytes, size, digits)}[/]") if over else text


def _peak_vs_none(v, base: int) -> str:
    return f"{100 * (v.measured_peak_bytes / base - 1):+.0f}%" if base else "n/a"


def _compact_cells(row, base: int, size: int, digits: int) -> tuple[str, ...]:
    v = row.verification
    return (row.label, Text.assemble(f"{in_unit(v.predicted_peak_bytes, size, digits)}/", _measured_peak(v, size, digits)), _peak_vs_none(v, base),
            f"{_ms(v.predicted_step_ms)}/{_ms(v.measured_step_ms)}",
            f"{v.predicted_overhead_pct:+.0f}%/{v.overhead_pct:+.0f}%", _grad_cell(v))


def _wide_cells(row, base: int, size: int, digits: int) -> tuple[str, ...]:
    v = row.verification
    counts = styled("[green]yes[/]" if v.recompute_counts_match else "[yellow]no[/]")
    return (row.label, in_unit(v.predicted_peak_bytes, size, digits), _measured_peak(v, size, digits), f"{v.peak_error_pct:+.1f}%",
            _peak_vs_none(v, base), f"{v.predicted_step_ms:.1f}", f"{v.measured_step_ms:.1f}",
            f"{v.predicted_overhead_pct:+.1f}%", f"{v.overhead_pct:+.1f}%", f"{v.paired_step_error_pct:+.1f}%",
            counts, _grad_cell(v))


def _baseline_measured_peak(result) -> int:
    """The measured peak of the ``none`` row (else of the profile's baseline step)."""
    rows = [r for r in result.rows if r.plan.strategy_name == "none"]
    return rows[0].verification.measured_peak_bytes if rows else result.profile.peak_bytes


def summary_lines(result) -> list[str]:
    """What the table says, in words: the baseline, and the largest saving with its cost."""
    rows = [r for r in result.rows if r.plan.strategy_name != "none"]
    base = result.profile.peak_bytes
    lines = [f"baseline (no recomputation): peak {format_bytes(base)}, step {result.profile.step_ms:.1f} ms "
             f"(model state {format_bytes(result.profile.model_state_bytes)} of it)."]
    if rows:
        best = min(rows, key=lambda r: r.verification.measured_peak_bytes)
        v = best.verification
        lines.append(f"lowest peak: {best.label}, {format_bytes(v.measured_peak_bytes)} "
                     f"({100 * (1 - v.measured_peak_bytes / base):.0f}% less) for {v.overhead_pct:+.0f}% step time.")
    over = [r.label for r in result.rows
            if r.verification.budget_bytes is not None and r.verification.measured_peak_bytes > r.verification.budget_bytes]
    if over:
        lines.append(f"measured peak over its budget (the prediction missed): {', '.join(over)}.")
    replays = [r.label for r in result.rows if not r.verification.recompute_counts_match]
    if replays:
        lines.append(f"ops replayed a different number of times than planned: {', '.join(replays)}.")
    drift = [r.verification.baseline_drift_pct for r in result.rows]
    lines.append(f"step times: medians of {result.repeats} side-by-side pairs (baseline, plan) per row; the step "
                 "error compares the plan with its prediction at the speed of the baseline timed beside it (the "
                 f"baseline itself ran {min(drift):+.0f}% to {max(drift):+.0f}% against the profile's times).")
    bad = [r.label for r in result.rows if not r.verification.ok]
    close = [r for r in result.rows if r.verification.ok and not r.verification.grads_identical]
    if bad:
        lines.append(f"GRADIENTS DIFFER for: {', '.join(bad)}.")
    elif close:
        lines.append(f"every gradient is identical to the baseline, or within its plan's stated tolerance "
                     f"({', '.join(r.label for r in close)}: {close[0].verification.tolerance_reason}).")
    else:
        lines.append("every gradient is identical to the baseline.")
    return lines


def render(result, title: str) -> None:
    console.print(verification_table(result, title))
    for line in summary_lines(result):
        console.print(line)


def _progress_to(status):
    return lambda message: status.update(Text(f"{message}..."))


SIZE_HELP = {
    "layers": "Blocks (gpt/hf layers, mlp depth, convnet blocks, unet levels).",
    "d_model": "Width (gpt/hf d_model, mlp width, convnet/unet channels).",
}


RUN_BUDGET = "40%"
"""`remat run`'s budget when none is given (raised to the least feasible peak where that is more)."""


@app.command("run")
def run_command(
    target: Optional[str] = typer.Argument(None, help=TARGET_HELP + " Overrides --model."),
    model: str = typer.Option("gpt", "--model", "-m", help=TARGET_HELP),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget: 6GiB, 750MB, 512MiB or 40% of the measured baseline peak. Default: 40% for --strategy optimal, raised to the least peak any plan reaches where that is more; none for the other strategies, which then run as they are.", show_default=False),
    strategy: str = typer.Option("optimal", "--strategy", "-s", help="none, full, every:K, sqrt, selective:<policy>, optimal."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="Measure this directory's disk and let the plan offload to it."),
    layers: Optional[int] = typer.Option(None, help=SIZE_HELP["layers"]),
    d_model: Optional[int] = typer.Option(None, "--d-model", help=SIZE_HELP["d_model"]),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    seq: Optional[int] = typer.Option(None, help="Sequence length (convnet, unet: image size)."),
    batch: Optional[int] = typer.Option(None, help="Batch size."),
    seed: int = typer.Option(0, help="Seed of the built-in model's weights and batch."),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    repeats: int = typer.Option(5, help="Timed pairs (baseline, plan) per plan, order swapped each round (medians)."),
    out: Path = typer.Option(RUN_OUT_DIR, "--out", "-o", help="Directory for profile, plan and verification JSON and report.html."),
    tune: bool = typer.Option(False, "--tune", help=TUNE_HELP),
    tune_steps: int = typer.Option(20, "--tune-steps", help=TUNE_STEPS_HELP),
    tune_seconds: float = typer.Option(30.0, "--tune-seconds", help=TUNE_SECONDS_HELP),
) -> None:
    """Profile, plan, apply and verify: the chosen plan against no recomputation, measured; then
    write the JSON files and the HTML report under --out and print the report's path."""
    from remat.apply.run import run_job
    from remat.models import sizes_from_options

    model = target or model
    options = dict(layers=layers, d_model=d_model, heads=heads, seq=seq, batch=batch)
    _check_offload_dir(offload_dir)
    check_output_dir(out, "--out")
    sizes = sizes_from_options(model, **options)
    asked = budget
    # a fixed strategy given no budget is run as it is: the default share is the optimal search's
    budget = asked if asked is not None else RUN_BUDGET if strategy == "optimal" else None
    with console.status("building...") as status:
        result = run_job(model, budget=budget, strategy=strategy, sizes=sizes, seed=seed,
                         repeats=repeats, offload_dir=None if offload_dir is None else str(offload_dir),
                         progress=_progress_to(status), device=device, tune=tune, tune_steps=tune_steps,
                         tune_seconds=tune_seconds, raise_to_floor=asked is None)
    if result.budget_note:
        console.print(f"note: {escape(result.budget_note)}", soft_wrap=True)
    if result.rows[-1].plan.tuning is not None:
        print_tuning(result.rows[-1].plan)
    within = " at the least peak" if result.budget_note else f" within {budget}" if budget is not None else ""
    render(result, f"remat run: {model}, {strategy}{within}")
    on = ["--device", device] if device else []
    disk = ["--offload-dir", str(offload_dir)] if offload_dir is not None else []  # the plan may offload there
    tuned = ["--tune", "--tune-steps", str(tune_steps), "--tune-seconds", f"{tune_seconds:g}"] if tune else []
    args = ["--model", model, "--strategy", strategy, *(["--budget", asked] if asked else []),
            *_size_args(options), "--seed", str(seed), *on, *disk, *tuned, "--out", str(out)]
    files = save_outputs(result, out, ["remat", "run", *args], chosen_row=len(result.rows) - 1)
    if files is not None:
        console.print(f"apply it again: remat verify {files.plans[-1]} --model {model}"
                      + "".join(f" {a}" for a in [*_size_args(options), *on, *disk]), soft_wrap=True)
    if not result.all_identical:
        raise typer.Exit(1)


def _check_offload_dir(offload_dir: Optional[Path]) -> None:
    """A directory that cannot be used fails before anything is built or measured."""
    if offload_dir is not None:
        from remat._diskio import check_offload_root

        check_offload_root(offload_dir)


def _size_args(options: dict) -> list[str]:
    """The size options that were given, as command-line arguments."""
    args: list[str] = []
    for name, value in options.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def save_outputs(result, out: Path, command: list[str], *, chosen_row: int | None = None):
    """Write the job's JSON files and report under ``out``, print where; the report's commands
    are ``command`` and the `remat report` call that rebuilds the page from the JSON files."""
    from remat.apply.run import output_files, write_outputs
    from remat.distributed import is_main_process

    if not is_main_process():  # under torchrun, rank 0 writes
        return None
    # the files by name: a glob would take a former run's files in the same folder too (another model's plans)
    paths = output_files(result, out)
    rebuild = shlex.join(["remat", "report", str(paths.profile), *map(str, paths.plans), *map(str, paths.verifications),
                          "-o", str(paths.report)])
    try:
        files = write_outputs(result, out, commands=[shlex.join(command), rebuild])
    except (ValueError, OSError) as error:
        raise fail(f"cannot write the results under {str(out)!r}: {describe(error)}") from None
    if chosen_row is not None:
        console.print(f"plan: {files.plans[chosen_row]}  verification: {files.verifications[chosen_row]}", soft_wrap=True)
    console.print(styled(f"JSON files in {escape(str(out))}/; report: [bold]{escape(str(files.report))}[/]"), soft_wrap=True)
    return files


@app.command("verify")
def verify_command(
    plan_path: Path = typer.Argument(..., help="A plan JSON written by `remat plan --out` or `remat run --out`."),
    model: str = typer.Option("gpt", "--model", "-m", help="The model the plan was made for (same sizes and seed)."),
    layers: Optional[int] = typer.Option(None, help=SIZE_HELP["layers"]),
    d_model: Optional[int] = typer.Option(None, "--d-model", help=SIZE_HELP["d_model"]),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    seq: Optional[int] = typer.Option(None, help="Sequence length (convnet, unet: image size)."),
    batch: Optional[int] = typer.Option(None, help="Batch size."),
    seed: int = typer.Option(0, help="Seed of the built-in model's weights and batch."),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="Where offload:disk blocks write."),
    repeats: int = typer.Option(5, help="Timed pairs (baseline, plan), order swapped each round (medians)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the Verification as JSON here."),
) -> None:
    """Apply a saved plan to the model and verify it against no recomputation."""
    from remat.apply.run import verify_job
    from remat.models import sizes_from_options
    from remat.plan.types import Plan

    _check_offload_dir(offload_dir)
    check_output_file(json_path, "--json")
    plan = Plan.load(plan_path)
    sizes = sizes_from_options(model, layers=layers, d_model=d_model, heads=heads, seq=seq, batch=batch)
    with console.status("building...") as status:
        result = verify_job(plan, model, sizes=sizes, seed=seed, repeats=repeats,
                            offload_dir=None if offload_dir is None else str(offload_dir), progress=_progress_to(status),
                            device=device)
    render(result, f"remat verify: {plan_path.name} on {model}")
    if json_path is not None and is_main_process():  # under torchrun, rank 0 writes
        result.rows[0].verification.save(json_path)
        console.print(f"verification written to {json_path}")
    if not result.all_identical:
        raise typer.Exit(1)
