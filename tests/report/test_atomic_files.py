"""Every output file is written whole or not at all: a serializer that raises, a full disk or a
figure that fails to encode leaves the old file (or none) and no temporary file."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
from matplotlib.figure import Figure

import remat._files as files
from remat._files import replacing, write_atomic
from remat.report import save_figure, write_report

from report_samples import make_plans, make_profile, make_verification


def _full_disk(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", fsync)


def test_written_whole_with_the_mode_open_would_give(tmp_path):
    path = write_atomic(tmp_path / "out.json", '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and os.listdir(tmp_path) == ["out.json"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and os.listdir(tmp_path) == ["out.json"]


def test_a_failing_serializer_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(TypeError, match="not JSON serializable"):
        with replacing(path) as f:
            f.write(b'{"half": ')
            json.dumps(object())
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


@pytest.mark.parametrize("kind", ["profile", "plan", "verification"])
def test_a_full_disk_leaves_no_document_and_no_temporary(tmp_path, monkeypatch, kind):
    doc = {"profile": make_profile, "plan": lambda: next(iter(make_plans().values())),
           "verification": make_verification}[kind]()
    _full_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        doc.save(tmp_path / f"{kind}.json")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_leaves_no_report_and_no_temporary(tmp_path, monkeypatch):
    profile, plans, verification = make_profile(), list(make_plans().values()), make_verification()
    _full_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        write_report(tmp_path / "report.html", profile, plans, [verification])
    assert os.listdir(tmp_path) == []


def test_a_figure_that_fails_to_encode_leaves_nothing(tmp_path, monkeypatch):
    fig = Figure()
    fig.add_subplot().plot([0, 1], [0, 1])
    save_figure(fig, tmp_path / "ok.png")
    assert (tmp_path / "ok.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def half_then_fail(f, **kwargs):
        f.write(b"\x89PNG partial")
        raise RuntimeError("renderer failed")

    monkeypatch.setattr(fig, "savefig", half_then_fail)
    with pytest.raises(RuntimeError, match="renderer failed"):
        save_figure(fig, tmp_path / "ok.png")
    with pytest.raises(RuntimeError, match="renderer failed"):
        save_figure(fig, tmp_path / "new.svg")
    assert os.listdir(tmp_path) == ["ok.png"] and (tmp_path / "ok.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
