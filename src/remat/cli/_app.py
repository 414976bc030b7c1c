"""The typer application every command module registers on, and how the CLI fails.

Every command runs inside `_guarded`: an expected failure (a bad value, a file that cannot be read
or written, an offload fault, an error in the user's ``file.py:build``) becomes one line
``error: <what, what is allowed, the fix>`` on stderr and exit status 2; ``remat --debug ...``
shows the traceback instead. Anything else is a bug and keeps its traceback.

User text is printed literally: the consoles render no markup and no emoji codes (a model named
``[bold red]X[/]`` prints as typed); the CLI's own styling goes through `styled`, with any user
text inside it passed through `rich.markup.escape`.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console
from rich.text import Text

from remat._diskio import OffloadError
from remat.models.loading import TargetCodeError

DEBUG_HELP = "Show the full traceback of an error instead of its one-line message."

EXPECTED = (ValueError, TypeError, OSError, OffloadError, TargetCodeError)
"""Failures the user can fix: reported in one line, never as a traceback (unless --debug)."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a user error (no traceback, the message literally, one line) and return the Exit to raise.
    Under torchrun a rank other than 0, whose output is quiet, says on stderr that it failed and
    where the error is printed: torchrun names the first rank to exit as the root cause."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", " ".join(message.split("\n"))), soft_wrap=True)
    if err_console.quiet:
        from remat.distributed import rank

        sys.stderr.write(f"remat: rank {rank()} failed (exit {code}); rank 0 prints the error.\n")
    return typer.Exit(code)


def describe(error: BaseException) -> str:
    """The one-line message of an expected failure."""
    if isinstance(error, OSError) and not isinstance(error, OffloadError) and error.strerror:
        where = error.filename if error.filename is not None else ""
        where += f" -> {error.filename2}" if error.filename2 is not None else ""
        return (f"{where or 'the operating system'}: {error.strerror} (errno {error.errno}); check that the path "
                "exists, is of the right kind and that you may read or write it, or choose another.")
    text = str(error) or type(error).__name__
    return text if isinstance(error, (ValueError, TypeError, OffloadError, TargetCodeError)) else f"{type(error).__name__}: {text}"


_invocation = {"debug": False}
"""Options of the group, set by its callback before each command runs."""


def _out_of_memory(error: RuntimeError) -> bool:
    """torch's out-of-memory errors: CUDA's (`torch.OutOfMemoryError`) and the CPU allocator's."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text


_REMAT_DIR = str(Path(__file__).resolve().parents[1])


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None, *, default: Callable[..., Any] = warnings.showwarning) -> None:
    """remat's own warnings as one line, ``warning: <message>``, as errors print (without ``--debug``);
    any other library's as Python shows them, with its file and line."""
    if issubclass(category, UserWarning) and str(Path(filename).resolve()).startswith(_REMAT_DIR):
        err_console.print(Text.assemble(("warning:", "bold yellow"), " ", " ".join(str(message).split("\n"))),
                          soft_wrap=True)
    else:
        default(message, category, filename, lineno, file, line)


def _guarded(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                if not _invocation["debug"]:
                    warnings.showwarning = _show_warning
                return command(*args, **kwargs)
        except EXPECTED as error:  # typer.Exit and usage errors are none of these: they pass
            if _invocation["debug"]:
                raise
            raise fail(describe(error)) from None
        except RuntimeError as error:  # the host or the device ran out of memory: sizes the user can change
            if _invocation["debug"] or not _out_of_memory(error):
                raise
            raise fail(f"the step ran out of memory ({str(error).splitlines()[0][:200]}); choose smaller sizes "
                       "(--seq, --batch, --layers...), or a device with more memory.") from None

    return run


class _GuardedTyper(typer.Typer):
    """A Typer whose commands fail in one line (`_guarded`)."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        register = super().command(*args, **kwargs)

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            register(_guarded(f))
            return f

        return decorator


app = _GuardedTyper(
    name="remat",
    help="Find the fastest training step that fits your memory: measure, plan, apply, verify, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEVICE_HELP = ("Device the model and batch run on: cpu, cuda, cuda:N (default: where they are built, the "
               "CPU for built-in models).")

TARGET_HELP = ("A built-in model (gpt, mlp, convnet, unet, hf:gpt2, hf:llama, hf:t5) or path/to/file.py:build where "
               "build() returns model, batch[, loss_fn[, optimizer]]. A file target is imported and its code "
               "runs with your permissions: name only files you trust.")

console = Console(markup=False, emoji=False)
err_console = Console(stderr=True, markup=False, emoji=False)


def styled(markup: str) -> Text:
    """The CLI's own styling (``[bold]...[/]``); escape user text inside it with `rich.markup.escape`."""
    return Text.from_markup(markup, emoji=False)


def move_debug_first(argv: list[str]) -> list[str]:
    """``remat profile x --debug`` as ``remat --debug profile x``: the flag belongs to the group
    (arguments after ``--`` are left alone)."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[:end]:
        return argv
    return ["--debug", *(a for a in argv[:end] if a != "--debug"), *argv[end:]]


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP)) -> None:
    """Under torchrun, join the process group; only rank 0 prints and writes files."""
    from remat.distributed import init_from_env, is_main_process

    _invocation["debug"] = debug
    if init_from_env() and not is_main_process():
        console.quiet = err_console.quiet = True


def main(argv: list[str] | None = None) -> None:
    """The ``remat`` entry point."""
    app(args=move_debug_first(list(sys.argv[1:] if argv is None else argv)), prog_name="remat")


def check_output_file(path: Any, option: str) -> None:
    """Fail before any work when ``path`` (the file ``option`` names) cannot be written: a
    directory there, or a folder that is missing or not writable. Else a long profile is lost to
    a typo at its end."""
    if path is None:
        return
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise fail(f"{option} {path}: a directory is there; pass a file path (e.g. {path / 'out.json'}).")
    _check_writable_folder(path.resolve().parent, f"{option} {path}")


def check_output_dir(path: Any, option: str) -> None:
    """Fail before any work when the directory ``option`` names cannot be made or written: the
    missing folders are made and a file written there, then removed again (permissions do not
    say it all: root may write everywhere but under /proc)."""
    import tempfile
    from pathlib import Path

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise fail(f"{option} {path}: a file is there, not a directory; pass a directory path.")
    missing, existing = [], path.resolve()
    while not existing.exists():
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise fail(f"{option} {path}: {existing} is a file, not a folder; pass a path under a directory.")
    _check_writable_folder(existing, f"{option} {path}")
    made = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        tempfile.TemporaryFile(dir=path.resolve()).close()
    except OSError as error:
        raise fail(f"{option} {path}: cannot write there ({describe(error)}); pass a directory you may write to.") from None
    finally:
        for folder in reversed(made):
            folder.rmdir()


def _check_writable_folder(folder: Any, what: str) -> None:
    import os

    if not folder.is_dir():
        raise fail(f"{what}: the folder {folder} does not exist; create it or pass a path in an existing folder.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise fail(f"{what}: the folder {folder} is not writable; pass a path you may write to.")
