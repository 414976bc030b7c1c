"""The typer application every command module registers on."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(
    name="remat",
    help="Find the fastest training step that fits your memory: measure, plan, apply, verify, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEVICE_HELP = ("Device the model and batch run on: cpu, cuda, cuda:N (default: where they are built, the "
               "CPU for built-in models).")

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a user error (no traceback) and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


@app.callback()
def _main() -> None:
    """Under torchrun, join the process group; only rank 0 prints and writes files."""
    from remat.distributed import init_from_env, is_main_process

    if init_from_env() and not is_main_process():
        console.quiet = err_console.quiet = True
