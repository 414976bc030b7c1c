"""Shared helpers for the quiz tests: run the ``remat`` CLI in-process or in a pseudo-terminal."""

from __future__ import annotations

import sys

import pytest
import torch

# Runs the `remat` app whether typer built it as a command group ("remat quiz ...") or, while
# `quiz` is its only command, as a single command ("remat ...").
RUN_REMAT = (
    "import sys, typer\n"
    "from remat.cli import app\n"
    "cmd = typer.main.get_command(app)\n"
    "args = sys.argv[1:] if hasattr(cmd, 'commands') else sys.argv[2:]\n"
    "cmd.main(args, prog_name='remat')\n"
)


@pytest.fixture
def remat_argv():
    """argv that runs ``remat <args>`` with this interpreter."""

    def make(*args: str) -> list[str]:
        return [sys.executable, "-c", RUN_REMAT, *args]

    return make


@pytest.fixture
def invoke():
    """Run ``remat <args>`` in-process; returns the click Result (exit_code, stdout, stderr)."""
    import typer
    from click.testing import CliRunner

    from remat.cli import app

    from remat.cli._app import console, err_console

    def run(*args: str, env: dict[str, str] | None = None):
        cmd = typer.main.get_command(app)
        argv = list(args) if hasattr(cmd, "commands") else list(args[1:])
        return CliRunner().invoke(cmd, argv, env=env, prog_name="remat")

    # Wide consoles: long lines stay whole whatever terminal (or none) the tests run under.
    saved = [(c, c._width, c._height) for c in (console, err_console)]
    console.size = err_console.size = (1000, 50)
    yield run
    for c, width, height in saved:
        c._width, c._height = width, height


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread per test process: tests run beside others on two shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
