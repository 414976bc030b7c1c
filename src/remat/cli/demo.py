"""`remat demo`: the default job. The built-in GPT, every strategy, one table, one HTML report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from remat.apply.run import DEFAULT_OUT_DIR
from remat.cli._app import DEVICE_HELP, app, check_output_dir, console
from remat.cli.run import render, save_outputs

DEMO_OUT_DIR = DEFAULT_OUT_DIR / "demo"


@app.command("demo")
def demo_command(
    repeats: int = typer.Option(5, help="Timed pairs (baseline, plan) per plan, order swapped each round (medians)."),
    seed: int = typer.Option(0, help="Seed of the model's weights and batch."),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    out: Path = typer.Option(DEMO_OUT_DIR, "--out", "-o", help="Directory for the JSON files and report.html."),
) -> None:
    """Profile the built-in GPT once; verify none, full, sqrt, two selective policies and optimal at
    three budgets: predicted and measured peak and step time, overhead, gradient check. Ends by
    writing the HTML report and printing its path."""
    from remat.apply.run import DEMO_SIZES, demo_job
    from remat.models import model_sizes

    check_output_dir(out, "--out")
    sizes = {**model_sizes("gpt"), **DEMO_SIZES}
    shown = ", ".join(f"{k}={sizes[k]}" for k in ("num_layers", "d_model", "num_heads", "seq_len", "batch_size"))
    with console.status("building...") as status:
        result = demo_job(seed=seed, repeats=repeats, progress=lambda m: status.update(Text(f"{m}...")), device=device)
    render(result, f"remat demo: built-in GPT ({shown}) on {result.profile.environment.device_name}")
    console.print("Peaks are exact live-storage accounts of a whole training step (weights, gradients, "
                  "AdamW state, activations); overhead is against the measured step without recomputation.")
    on = ["--device", device] if device else []
    save_outputs(result, out, ["remat", "demo", "--seed", str(seed), *on, "--repeats", str(repeats), "--out", str(out)])
    if not result.all_identical:
        raise typer.Exit(1)
