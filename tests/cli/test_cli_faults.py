"""Bad inputs and faults through the CLI: each is one line ``error: ...`` on stderr with exit
status 2 (``--debug``: the traceback), user text printed as typed, and nothing left behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from remat._diskio import OffloadError
from remat.cli import app
from remat.cli._app import _GuardedTyper, _invocation, move_debug_first
from remat.models.loading import TargetCodeError

runner = CliRunner()

SYNTAX = "def build(:\n    pass\n"
RAISES = "import torch\n\ndef build():\n    return 1 / 0\n"
EXITS = "import sys\n\ndef build():\n    sys.exit(0)\n"
AT_IMPORT = "raise RuntimeError('at import')\n"


def _one_line_error(result, exit_code: int = 2) -> str:
    """The single stderr line of a failed command, without its ``error: `` prefix."""
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0].removeprefix("error: ")


def _user_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    (SYNTAX, r"{path} does not parse: SyntaxError: invalid syntax \({path} line 1\); fix the file \(remat ran its code\)"),
    (RAISES, r"{path}:build raised ZeroDivisionError: division by zero \({path} line 4\); fix the file"),
    (EXITS, r"{path}:build raised SystemExit\(0\) \({path} line 4\): sys.exit\(\) or exit\(\) ran instead of returning "
            r"\(model, batch\[, loss_fn\[, optimizer\]\]\); return them"),
    (AT_IMPORT, r"importing {path} for {path}:build raised RuntimeError: at import \({path} line 1\)"),
], ids=["syntax-error", "exception-in-build", "sys-exit-0-in-build", "exception-at-import"])
def test_an_error_in_the_build_file_is_one_line_and_writes_nothing(tmp_path, text, message):
    import re

    path = _user_file(tmp_path, text)
    modules = set(sys.modules)
    result = runner.invoke(app, ["profile", f"{path}:build", "--json", str(tmp_path / "p.json")])
    assert re.fullmatch(message.format(path=re.escape(str(path))) + ".*", _one_line_error(result))
    assert sorted(os.listdir(tmp_path)) == ["mine.py"]  # no profile written
    assert not {m for m in set(sys.modules) - modules if m.startswith("remat_user_")}  # the failed module is gone


def test_debug_raises_with_the_users_exception_chained(tmp_path):
    path = _user_file(tmp_path, RAISES)
    result = runner.invoke(app, ["--debug", "profile", f"{path}:build"])
    assert result.exit_code == 1 and isinstance(result.exception, TargetCodeError)
    assert isinstance(result.exception.__cause__, ZeroDivisionError)
    _invocation["debug"] = False


def test_debug_after_the_command_shows_the_traceback(tmp_path):
    assert move_debug_first(["profile", "x", "--debug"]) == ["--debug", "profile", "x"]
    assert move_debug_first(["profile", "--", "--debug"]) == ["profile", "--", "--debug"]
    path = _user_file(tmp_path, RAISES)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    plain = subprocess.run([sys.executable, "-m", "remat.cli", "profile", f"{path}:build"],
                           capture_output=True, text=True, env=env, timeout=120)
    debug = subprocess.run([sys.executable, "-m", "remat.cli", "profile", f"{path}:build", "--debug"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1 and "Traceback" not in plain.stderr
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert f'File "{path}", line 4, in build' in debug.stderr and "ZeroDivisionError: division by zero" in debug.stderr


@pytest.mark.parametrize("args, message", [
    (["profile", "[bold red]X[/]"], "unknown model '[bold red]X[/]'"),
    (["profile", ":thumbs_up: [link=http://x]y[/link]"], "':thumbs_up: [link=http://x]y[/link]'"),
    (["quiz", "--answers", "[bold red]X[/]"], "--answers has 1 entries ('[bold red]X[/]')"),
], ids=["markup-model-name", "emoji-and-link", "markup-answers"])
def test_user_text_is_printed_as_typed(args, message):
    assert message in _one_line_error(runner.invoke(app, args))


def _guarded_app(error: BaseException) -> typer.Typer:
    probe = _GuardedTyper()

    @probe.command()
    def fails() -> None:
        raise error

    @probe.command()
    def other() -> None:  # two commands, so `fails` is a subcommand
        pass

    return probe


@pytest.mark.parametrize("error, message", [
    (OffloadError("could not write offload file /x/1.bin for block 'b': No space left on device (errno 28); the disk "
                  "is full: free space or choose another --offload-dir."),
     "could not write offload file /x/1.bin for block 'b': No space left on device (errno 28); the disk is full"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/p.json"),
     "/data/p.json: No space left on device (errno 28); check that the path exists"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/etc/a", None, "/etc/b"),
     "/etc/a -> /etc/b: Permission denied (errno 13)"),
    (TypeError("budget=True is a bool; pass bytes as an int."), "budget=True is a bool; pass bytes as an int."),
    (ValueError("two\nlines"), "two lines"),
], ids=["offload-error", "oserror-enospc", "permission-two-paths", "type-error", "multi-line-value-error"])
def test_expected_failures_are_one_line(error, message):
    got = _one_line_error(runner.invoke(_guarded_app(error), ["fails"]))
    assert got.startswith(message), got


def test_a_bug_keeps_its_traceback():
    result = runner.invoke(_guarded_app(KeyError("bug")), ["fails"])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)


@pytest.mark.parametrize("command", ["run", "verify"])
def test_offload_dir_with_a_missing_parent_fails_before_anything_runs(tmp_path, command):
    args = ["run", "--model", "mlp"] if command == "run" else ["verify", str(tmp_path / "plan.json")]
    result = runner.invoke(app, [*args, "--offload-dir", str(tmp_path / "a" / "b"), "--out", str(tmp_path / "out")]
                           if command == "run" else [*args, "--offload-dir", str(tmp_path / "a" / "b")])
    assert _one_line_error(result) == (
        f"offload directory '{tmp_path}/a/b' cannot be made: its parent '{tmp_path}/a' is not an existing directory "
        "(only the last component is created); create the parent first or name an existing directory.")
    assert os.listdir(tmp_path) == []


def test_unwritable_outputs_are_one_line_and_leave_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    result = runner.invoke(app, ["profile", "--model", "mlp", "--layers", "2", "--d-model", "8", "--batch", "2",
                                 "--repeats", "1", "--warmup", "0", "--json", str(tmp_path / "file" / "p.json")])
    assert _one_line_error(result) == (f"--json {tmp_path}/file/p.json: the folder {tmp_path}/file does not exist; "
                                       "create it or pass a path in an existing folder.")  # before any work
    profile_path = tmp_path / "p.json"
    runner.invoke(app, ["profile", "--model", "mlp", "--layers", "2", "--d-model", "8", "--batch", "2",
                        "--repeats", "1", "--warmup", "0", "--json", str(profile_path)])
    result = runner.invoke(app, ["plan", str(profile_path), "-o", str(tmp_path / "missing" / "plan.json")])
    assert _one_line_error(result).startswith(f"--out {tmp_path}/missing/plan.json: the folder {tmp_path}/missing does not exist")
    result = runner.invoke(app, ["report", str(profile_path), "-o", str(tmp_path / "file" / "r.html")])
    assert _one_line_error(result).startswith(f"{tmp_path}/file: File exists (errno 17)")
    assert sorted(os.listdir(tmp_path)) == ["file", "p.json"]


HF = ["estimate", "--hf", "llama", "--hidden", "64", "--layers", "2", "--heads", "4", "--intermediate", "128",
      "--vocab", "100", "--seq", "32"]


@pytest.mark.parametrize("extra, message", [
    (["--heads", "5"], "--hf llama: hidden size 64 is not a multiple of 5 attention heads (each head gets hidden/heads "
                       "features); pass --heads dividing --hidden, e.g. 2, 4, 8."),
    (["--kv-heads", "3"], "--hf llama: 4 attention heads are not a multiple of 3 key/value heads (grouped-query attention "
                          "shares each key/value head among heads/kv-heads query heads); pass --kv-heads dividing --heads, "
                          "e.g. 1, 2, 4."),
    (["--hidden", "-64"], "--hf llama: hidden = -64 (--hidden) must be a positive integer; pass --hidden N with N >= 1."),
    (["--intermediate", "0"], "--hf llama: intermediate = 0 (--intermediate) must be a positive integer"),
    (["--vocab", "-1"], "--hf llama: vocab = -1 (--vocab) must be a positive integer"),
    (["--layers", "10000000"], "--hf llama: 10000000 layers is more than the 1024 an estimate takes"),
], ids=["heads-not-dividing-hidden", "kv-heads-not-dividing-heads", "negative-hidden", "zero-intermediate",
        "negative-vocab", "ten-million-layers"])
def test_estimate_refuses_bad_sizes_up_front(extra, message):
    assert _one_line_error(runner.invoke(app, HF + extra)).startswith(message)


def test_estimate_checks_a_family_default_against_the_sizes_given():
    # Mistral's config defaults to 8 key/value heads: 4 heads given without --kv-heads cannot share them
    args = ["estimate", "--hf", "mistral", *HF[3:]]
    assert _one_line_error(runner.invoke(app, args)).startswith(
        "--hf mistral (sizes not given are the family's defaults): 4 attention heads are not a multiple of 8 "
        "key/value heads")


def test_estimate_refuses_a_bad_config_file_and_a_deep_builtin(tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 3, "num_hidden_layers": 2, "intermediate_size": 128,
                                  "vocab_size": 100}))
    got = _one_line_error(runner.invoke(app, ["estimate", "--config", str(config), "--seq", "32"]))
    assert got.startswith(f"config '{config}': 4 attention heads are not a multiple of 3 key/value heads")
    config.write_text("{not json")
    got = _one_line_error(runner.invoke(app, ["estimate", "--config", str(config)]))
    assert got.startswith(f"config file '{config}' is not JSON (Expecting property name")
    got = _one_line_error(runner.invoke(app, ["estimate", "--model", "gpt", "--layers", "5000"]))
    assert got.startswith("--model gpt: 5000 layers is more than the 1024 an estimate takes")


def test_model_source_sizes_are_checked_as_the_cli_checks_them():
    from remat.estimate import ModelSource

    with pytest.raises(ValueError, match=r"--hf llama: layers = True \(--layers\) must be a positive integer"):
        ModelSource(hf_family="llama", sizes={"layers": True})
    with pytest.raises(ValueError, match=r"hidden size 100 is not a multiple of 7 attention heads"):
        ModelSource(hf_family="mistral", sizes={"hidden": 100, "heads": 7})


def test_a_quiet_rank_says_it_failed_and_where_the_error_is(capsys, monkeypatch):
    """Under torchrun only rank 0 prints; a rank whose plan failed exited with status 2 and no
    word, and torchrun named it as the root cause."""
    from remat.cli import _app

    monkeypatch.setattr(_app.err_console, "quiet", True)
    monkeypatch.setattr("remat.distributed.rank", lambda: 1)
    exit_ = _app.fail("no plan fits the budget")
    assert exit_.exit_code == 2
    assert capsys.readouterr().err == "remat: rank 1 failed (exit 2); rank 0 prints the error.\n"


FROZEN = ("import torch\n\ndef build():\n    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n"
          "    model.requires_grad_(False)\n    return model, torch.randn(2, 4), lambda out, batch: out.sum()\n")
HUGE = ("import torch\n\ndef build():\n    class Huge(torch.nn.Module):\n        def forward(self, x):\n"
        "            raise RuntimeError('[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can\\'t allocate "
        "memory: you tried to allocate 1280000000000 bytes.')\n    return Huge(), torch.randn(2, 4), None\n")


def test_a_target_file_that_is_not_python_is_one_line(tmp_path):
    """``remat profile plan.json:build`` raised AttributeError ('NoneType' object has no attribute 'loader')."""
    target = tmp_path / "plan.json"
    target.write_text("{}")
    message = _one_line_error(runner.invoke(app, ["profile", f"{target}:build"]))
    assert f"{str(target)!r} is not a Python file Python can import (it needs the .py suffix)" in message


def test_a_model_with_nothing_to_train_is_one_line(tmp_path):
    """Every parameter frozen: the backward raised torch's 'element 0 of tensors does not require grad'."""
    path = _user_file(tmp_path, FROZEN)
    message = _one_line_error(runner.invoke(app, ["profile", f"{path}:build"]))
    assert message.startswith("loss_fn(output, batch) needs no gradient: no parameter the step used requires grad")


def test_running_out_of_memory_is_one_line_naming_the_sizes(tmp_path):
    """The host allocator's failure on a size too large (`--seq 100000`) was a traceback after minutes."""
    path = _user_file(tmp_path, HUGE)
    message = _one_line_error(runner.invoke(app, ["profile", f"{path}:build"]))
    assert message.startswith("the step ran out of memory ([enforce fail at alloc_cpu.cpp:127]")
    assert "choose smaller sizes" in message
    other = _user_file(tmp_path, RAISES.replace("1 / 0", "torch.empty(2).view(3)"))  # any other RuntimeError
    assert "Traceback" not in runner.invoke(app, ["profile", f"{other}:build"]).output  # build errors: one line as before


@pytest.mark.parametrize("argv, message", [
    (["profile", "--model", "mlp", "--json", "{tmp}"], "--json {tmp}: a directory is there; pass a file path"),
    (["profile", "--model", "mlp", "--json", "{tmp}/no/such/p.json"], "--json {tmp}/no/such/p.json: the folder {tmp}/no/such does not exist"),
    (["plan", "--model", "mlp", "--out", "{tmp}"], "--out {tmp}: a directory is there"),
    (["run", "--model", "mlp", "--out", "{tmp}/afile"], "--out {tmp}/afile: a file is there, not a directory"),
    (["demo", "--out", "{tmp}/afile"], "--out {tmp}/afile: a file is there, not a directory"),
    # a file on the way: it said "the folder {tmp}/afile does not exist"
    (["run", "--model", "mlp", "--out", "{tmp}/afile/sub"], "--out {tmp}/afile/sub: {tmp}/afile is a file, not a folder"),
    # writable to root by its permissions, but nothing can be made there: it failed after the whole job
    (["run", "--model", "mlp", "--out", "/proc/remat-out/run"], "--out /proc/remat-out/run: cannot write there"),
], ids=["profile-json-dir", "profile-json-missing-folder", "plan-out-dir", "run-out-file", "demo-out-file",
        "run-out-under-file", "run-out-uncreatable"])
def test_an_output_path_that_cannot_be_written_fails_before_any_work(tmp_path, argv, message):
    """The output path was checked after the profile and the verification: `remat demo --out
    /sys/demo` failed after 25 s, its work lost."""
    (tmp_path / "afile").write_text("mine")
    argv = [a.format(tmp=tmp_path) for a in argv]
    got = _one_line_error(runner.invoke(app, argv))
    assert got.startswith(message.format(tmp=tmp_path)), got
    assert sorted(os.listdir(tmp_path)) == ["afile"] and (tmp_path / "afile").read_text() == "mine"


def test_a_hub_model_name_is_told_remat_never_downloads():
    """``hf:meta-llama/Llama-2-7b-hf`` was told to ``pip install remat[hf]`` with transformers installed."""
    pytest.importorskip("transformers")
    message = _one_line_error(runner.invoke(app, ["profile", "hf:meta-llama/Llama-2-7b-hf"]))
    assert "never downloads one: name hf:gpt2, hf:llama or hf:t5, or build yours in a file" in message
    assert "pip install" not in message
