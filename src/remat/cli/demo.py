"""`remat demo`: the default job. The built-in GPT, every strategy, one table."""

from __future__ import annotations

import typer

from remat.cli._app import app, console, fail
from remat.cli.run import render


@app.command("demo")
def demo_command(
    repeats: int = typer.Option(3, help="Timed steps per plan (the median is kept)."),
    seed: int = typer.Option(0, help="Seed of the model's weights and batch."),
) -> None:
    """Profile the built-in GPT once; verify none, full, sqrt, two selective policies and optimal at
    three budgets: predicted and measured peak and step time, overhead, gradient check."""
    from remat.apply.run import DEMO_SIZES, demo_job

    sizes = ", ".join(f"{k}={v}" for k, v in DEMO_SIZES.items())
    try:
        with console.status("building...") as status:
            result = demo_job(seed=seed, repeats=repeats, progress=lambda m: status.update(f"{m}..."))
    except (ValueError, TypeError) as error:
        raise fail(str(error)) from None
    render(result, f"remat demo: built-in GPT ({sizes}) on {result.profile.environment.device_name}")
    console.print("Peaks are exact live-storage accounts of a whole training step (weights, gradients, "
                  "AdamW state, activations); overhead is against the measured step without recomputation.")
    if not result.all_identical:
        raise typer.Exit(1)
