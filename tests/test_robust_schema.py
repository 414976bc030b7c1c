"""Plans and profiles are read through one strict schema: each bad document is refused with a
message naming the field and the fix, and nothing is read that is not a regular JSON file."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
from pathlib import Path

import pytest
import torch

import remat
from remat import _serialize
from remat.measure.types import Profile, block_names_hash
from remat.models import build
from remat.plan.planners import plan as make_plan
from remat.plan.types import Plan
from remat.verify_types import Verification


@functools.cache
def _documents() -> tuple[str, str]:
    """(profile JSON, optimal plan JSON) of a tiny MLP whose plan nests recompute children."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        built = build("mlp", depth=4, width=32, batch_size=4)
        prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer)
    finally:
        torch.set_num_threads(before)
    return prof.to_json(), make_plan(prof, strategy="full").to_json()


def _profile() -> dict:
    return json.loads(_documents()[0])


def _plan() -> dict:
    return json.loads(_documents()[1])


def _refused(cls, doc: dict | str, match: str, error: type[Exception] = ValueError) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(error, match=match):
        cls.from_json(text)


def test_documents_round_trip_exactly(tmp_path):
    profile_text, plan_text = _documents()
    prof, plan = Profile.from_json(profile_text), Plan.from_json(plan_text)
    assert prof.to_json() == profile_text and plan.to_json() == plan_text
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan and Plan.load(str(tmp_path / "plan.json")) == plan


# --- profile: numbers -----------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "match"), [
    ("fwd_ms", -1000, r"data\.blocks\[1\]\.fwd_ms is -1000\.0; times of 'fwd_ms' must be >= 0\. .*regenerate it with `remat profile`"),
    ("saved_bytes", -1, r"data\.blocks\[1\]\.saved_bytes is -1; sizes of 'saved_bytes' must be >= 0"),
    ("saved_bytes", True, r"data\.blocks\[1\]\.saved_bytes is a boolean True; expected an integer"),
    ("saved_bytes", 1.5, r"data\.blocks\[1\]\.saved_bytes is a number 1\.5; expected an integer"),
    ("saved_bytes", "1024", r"data\.blocks\[1\]\.saved_bytes is a string '1024'; expected an integer"),
    ("saved_bytes", None, r"data\.blocks\[1\]\.saved_bytes is null; expected an integer"),
    ("fwd_flops", [1], r"data\.blocks\[1\]\.fwd_flops is an array \[1\]; expected an integer"),
    ("name", 7, r"data\.blocks\[1\]\.name is an integer 7; expected a string"),
    ("follows_previous", 1, r"data\.blocks\[1\]\.follows_previous is an integer 1; expected a boolean"),
    ("fwd_live_bytes", 3, r"data\.blocks\[1\]\.fwd_live_bytes is an integer; expected an array"),
    ("saved_bytes", 2**64, r"data\.blocks\[1\]\.saved_bytes is 18446744073709551616; integers must lie within"),
])
def test_block_fields_of_the_wrong_type_or_range_are_refused(field, value, match):
    doc = _profile()
    doc["data"]["blocks"][1][field] = value
    _refused(Profile, doc, match)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(constant):
    text = _documents()[0].replace('"saved_bytes": ', f'"saved_bytes": {constant}, "x": ', 1)
    _refused(Profile, text, f"^profile JSON holds {constant}; every number must be finite")
    text = _documents()[0].replace('"step_ms": ', f'"step_ms": {constant}, "y": ', 1)
    _refused(Profile, text, f"holds {constant}")


@pytest.mark.parametrize(("where", "value", "match"), [
    (("bandwidths", "overlap_fraction"), 1.5, r"data\.bandwidths\.overlap_fraction is 1\.5; a fraction must be in \[0, 1\]"),
    (("environment", "num_threads"), 0, r"data\.environment\.num_threads is 0; values of 'num_threads' must be >= 1"),
    (("peak_bytes_by_category", "activations"), -5, r"data\.peak_bytes_by_category\.activations is -5; .*must be >= 0"),
    (("optimizer_step_ms",), -0.5, r"data\.optimizer_step_ms is -0\.5; times of 'optimizer_step_ms' must be >= 0"),
    (("fingerprint",), "abc", r"data\.fingerprint is a string; expected an object \(Fingerprint\)"),
])
def test_profile_fields_out_of_range_are_refused(where, value, match):
    doc = _profile()
    target = doc["data"]
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    _refused(Profile, doc, match)


def test_missing_unknown_and_duplicate_fields_are_refused():
    doc = _profile()
    del doc["data"]["blocks"][0]["fwd_ms"]
    _refused(Profile, doc, r"data\.blocks\[0\] \(BlockProfile\) lacks the field\(s\) \['fwd_ms'\]")
    doc = _profile()
    doc["data"]["blocks"][0]["fwd_seconds"] = 1.0
    _refused(Profile, doc, r"data\.blocks\[0\] \(BlockProfile\) has unknown field\(s\) \['fwd_seconds'\]")
    text = _documents()[0].replace('"param_bytes": ', '"param_bytes": 1, "param_bytes": ', 1)
    _refused(Profile, text, "^profile JSON has the key 'param_bytes' twice in one object")
    doc = _profile()
    doc["extra"] = 1
    _refused(Profile, doc, r"must hold exactly the keys format, version, data; got \['data', 'extra', 'format', 'version'\]")


@pytest.mark.parametrize(("version", "kind", "match"), [
    (True, "profile", r"profile JSON version True is not supported \(this remat reads version 1\)"),
    ("1", "profile", r"profile JSON version '1' is not supported"),
    (2, "profile", r"version 2 is not supported"),
    (1, "plan", r"expected a remat 'profile' JSON document, got format='plan'"),
])
def test_format_and_version_must_match_exactly(version, kind, match):
    doc = _profile()
    doc["version"], doc["format"] = version, kind
    _refused(Profile, doc, match)


def test_profile_blocks_must_be_numbered_uniquely_named_and_stacked_in_order():
    doc = _profile()
    doc["data"]["blocks"][2]["index"] = 3
    _refused(Profile, doc, r"blocks\[2\] has index 3; blocks are numbered 0\.\. in order")
    doc = _profile()
    doc["data"]["blocks"][2]["name"] = doc["data"]["blocks"][1]["name"]
    _refused(Profile, doc, r"blocks\[2\] is named '.*', empty or the name of an earlier block")
    doc = _profile()
    names = [b["name"] for b in doc["data"]["blocks"]]
    assert doc["data"]["fingerprint"]["block_names_hash"] == block_names_hash(names)  # recorded by profile()
    doc["data"]["blocks"][3]["name"] = "head"
    _refused(Profile, doc, r"the blocks' names \[.*'head'\] do not match the fingerprint's block_names_hash")
    doc = _profile()
    assert doc["data"]["stacks"], "the MLP profile records its stack"
    doc["data"]["stacks"][0]["stop"] -= 1
    _refused(Profile, doc, r"the stacks cover 3 blocks, the profile has 4")
    doc = _profile()
    doc["data"]["stacks"].append(dict(doc["data"]["stacks"][0]))
    _refused(Profile, doc, r"stacks cover the blocks in order without gap or overlap, so it must start at 4")


# --- plan -------------------------------------------------------------------------------------

def _segment(start, stop, strategy="recompute", children=()):
    return {"start": start, "stop": stop, "strategy": strategy, "saved_ops": [], "children": list(children)}


@pytest.mark.parametrize(("segments", "match"), [
    ([_segment(0, 4, children=[_segment(0, 2), _segment(1, 3)])],
     r"child segments of \[0, 4\) must be in order without overlap; \[1, 3\) starts before 2"),
    ([_segment(0, 4, children=[_segment(2, 3), _segment(0, 1)])],
     r"\[0, 1\) starts before 3, where the child before it ends"),
    ([_segment(0, 2, children=[_segment(1, 3)]), _segment(2, 4)],
     r"child segment \[1, 3\) lies outside its parent \[0, 2\)"),
    ([_segment(0, 2), _segment(3, 4)], r"segment \[3, 4\) starts at 3, expected 2"),
    ([_segment(0, 2), _segment(1, 4)], r"segment \[1, 4\) starts at 1, expected 2"),
    ([_segment(0, 3)], r"plan segments cover 3 blocks but the plan names 4"),
    ([_segment(0, 4, strategy="fused")], r"unknown strategy 'fused'"),
    ([_segment(0, 4, strategy="keep", children=[_segment(0, 1)])], r"only recompute segments may nest"),
    ([_segment(2, 2), _segment(0, 4)], r"segment \[2, 2\) is empty or negative"),
    ([_segment(0, 1, strategy="selective:"), _segment(1, 4)], r"selective strategy 'selective:' names no policy"),
    ([{**_segment(0, 1, strategy="selective:save-matmuls"), "saved_ops": ["addmm"]}, _segment(1, 4)],
     r"saved op key 'addmm' of segment \[0, 1\) is not an op key like 'aten\.mm\.default#0'"),
    ([{**_segment(0, 4), "saved_ops": ["aten.mm.default#0"]}], r"is 'recompute' but names saved_ops"),
    ([_segment(0, 4, strategy="offload:gpu")], r"unknown offload target 'offload:gpu'"),
    ([_segment(-1, 4)], r"data\.segments\[0\]\.start is -1; values of 'start' must be >= 0"),
])
def test_plan_segments_must_partition_the_blocks(segments, match):
    doc = _plan()
    doc["data"]["segments"] = segments
    _refused(Plan, doc, match)


@pytest.mark.parametrize(("names", "match"), [
    (["layers.0", "layers.0", "layers.2", "layers.3"], r"block_names\[1\] 'layers\.0' appears twice"),
    (["", "layers.1", "layers.2", "layers.3"], r"block_names\[0\] is ''; a block name is the qualified name of a submodule"),
    ([" layers.0", "layers.1", "layers.2", "layers.3"], r"block_names\[0\] is ' layers\.0'.*padded with spaces"),
])
def test_plan_block_names_are_unique_and_name_submodules(names, match):
    doc = _plan()
    doc["data"]["block_names"] = names
    _refused(Plan, doc, match)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("budget_bytes", 0, r"data\.budget_bytes is 0; sizes of 'budget_bytes' must be >= 1"),
    ("budget_bytes", -1, r"data\.budget_bytes is -1"),
    ("strategy_name", None, r"data\.strategy_name is null; expected a string"),
])
def test_plan_fields_out_of_range_are_refused(field, value, match):
    doc = _plan()
    doc["data"][field] = value
    _refused(Plan, doc, match)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("peak_block", -2, r"data\.prediction\.peak_block is -2; values of 'peak_block' must be >= -1"),
    ("step_ms", -1.0, r"data\.prediction\.step_ms is -1\.0; times of 'step_ms' must be >= 0"),
    ("retained_bytes", [1, -1, 0, 0], r"data\.prediction\.retained_bytes\[1\] is -1"),
    ("peak_bytes", 2.0, r"data\.prediction\.peak_bytes is a number 2\.0; expected an integer"),
])
def test_plan_prediction_out_of_range_is_refused(field, value, match):
    doc = _plan()
    doc["data"]["prediction"][field] = value
    _refused(Plan, doc, match)


# --- text against files -------------------------------------------------------------------------

def test_from_json_takes_text_never_a_path(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(_documents()[1])
    with pytest.raises(TypeError, match=r"Plan\.from_json takes JSON text \(str\), got PosixPath; to read a file use Plan\.load\(path\)"):
        Plan.from_json(path)
    _refused(Plan, str(path), rf"plan JSON text is not valid JSON .* it starts '{re.escape(str(path)[:60])}'.*load\(path\)")
    _refused(Plan, "", "plan JSON text is empty")
    _refused(Plan, "/dev/zero", r"not valid JSON .* it starts '/dev/zero'")
    with pytest.raises(TypeError, match="takes JSON text"):
        Profile.from_json(_documents()[0].encode())


def _unchanged(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before


def test_a_file_holding_a_path_is_not_followed(tmp_path):
    """The text of a file is never read as another path (today's '/dev/zero' ran out of memory)."""
    for content in ("/dev/zero", "/etc/passwd", str(tmp_path / "plan.json")):
        path = tmp_path / "pointer.json"
        path.write_text(content)
        with pytest.raises(ValueError, match=f"not valid JSON .* it starts '{re.escape(content[:60])}'"):
            Plan.load(path)
        _unchanged(path, content.encode())


def test_only_regular_files_of_bounded_size_are_read(tmp_path, monkeypatch):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"Plan\.load: '.*empty\.json' is empty"):
        Plan.load(empty)
    with pytest.raises(ValueError, match=r"'/dev/zero' is not a regular file \(a character device\)"):
        Profile.load("/dev/zero")
    with pytest.raises(ValueError, match=r"is not a regular file \(a directory\)"):
        Profile.load(tmp_path)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        Plan.load(binary)
    big = tmp_path / "profile.json"
    big.write_text(_documents()[0])
    monkeypatch.setattr(_serialize, "MAX_DOCUMENT_BYTES", 1000)
    with pytest.raises(ValueError, match=rf"is {big.stat().st_size} bytes; at most 1000 allowed"):
        Profile.load(big)
    with pytest.raises(ValueError, match=r"profile JSON text is \d+ characters; at most 1000 allowed"):
        Profile.from_json(_documents()[0])
    with pytest.raises(TypeError, match="a path must be a str or a pathlib.Path, got int"):
        Plan.load(3)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: outcome.append(pytest.raises(ValueError, Plan.load, fifo).value))
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert "is not a regular file (a FIFO)" in str(outcome[0])


def test_an_endless_integer_is_refused():
    _refused(Profile, _documents()[0].replace('"param_bytes": ', '"param_bytes": ' + "9" * 5000 + ", \"w\": ", 1),
             r"profile JSON text is not valid JSON \(Exceeds the limit \(4300 digits\)")


def test_nesting_is_bounded():
    deep = "[" * (_serialize.MAX_DEPTH + 5) + "]" * (_serialize.MAX_DEPTH + 5)
    _refused(Plan, '{"format": "plan", "version": 1, "data": ' + deep + "}",
             rf"plan JSON nests {_serialize.MAX_DEPTH + 6} levels deep; at most {_serialize.MAX_DEPTH} allowed")
    _refused(Plan, "[" * 200_000 + "]" * 200_000, rf"nests deeper than {_serialize.MAX_DEPTH} levels")


def test_a_verification_keeps_its_infinite_differences():
    """Verifications record an infinite difference (shapes differ, a NaN): they allow Infinity."""
    text = json.dumps({"format": "verification", "version": 1, "data": {"x": 1}})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['x'\]"):
        Verification.from_json(text)
    assert math.isinf(json.loads('{"a": Infinity}')["a"])
