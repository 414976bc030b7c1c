"""The device check runs before a GPU is lent: its small version on the CPU, its pieces on toys."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is outside the package

from benchmarks import device_check  # noqa: E402
from benchmarks._device import sections  # noqa: E402
from benchmarks._device.allocator import allocator_peaks, state_bytes  # noqa: E402
from benchmarks._device.config import STRATEGIES  # noqa: E402
from remat.models import BuiltModel  # noqa: E402


def _numbers(value, path="$"):
    """Every int and float in a JSON document, with its path (booleans are not numbers here)."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.slow
def test_small_check_on_the_cpu(tmp_path):
    """The whole small run, once (it is the costly part: one test, so parallel workers do not each
    run it). Its duration is a benchmark's figure (BENCHMARKS.md, "Test suite"), not a test's."""
    status = device_check.main(["--device", "cpu", "--size", "small", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert status == 0
    _is_complete_and_finite(results)
    _verifies_every_model_and_plan(results["sections"]["models"]["data"])
    _measures_attention_core_and_the_peers(results["sections"])
    _estimates_what_it_measures(results["sections"]["estimate"]["data"])
    _times_segments_of_every_length(results["sections"]["segments"]["data"])
    _writes_markdown_with_date_device_and_torch(results, (tmp_path / "results.md").read_text())


def _is_complete_and_finite(results: dict) -> None:
    assert (results["format"], results["version"]) == ("remat-device-check", 1)
    assert results["non_finite"] == []
    assert all(math.isfinite(v) for _, v in _numbers(results))
    env = results["environment"]
    assert env["device"] == "cpu" and env["torch_version"] == torch.__version__ and env["date_utc"].endswith("UTC")
    got = {name: s["status"] for name, s in results["sections"].items()}
    assert got == {"models": "ok", "attention_core": "ok", "host_offload": "skipped", "estimate": "ok", "segments": "ok",
                   "peers": "ok"}
    assert "CUDA tensors" in results["sections"]["host_offload"]["note"]


def _verifies_every_model_and_plan(data: dict) -> None:
    assert data["allocator"].startswith("CUDA only")
    expected = {"gpt", "mlp", "convnet"} | ({"hf:llama"} if not data["skipped_models"] else set())
    assert {r["model"] for r in data["rows"]} == expected
    for model in expected:
        plans = [r["plan"] for r in data["rows"] if r["model"] == model]
        # two budgets give one row when they round to the same plan budget (the floor is the top)
        assert tuple(plans[:4]) == STRATEGIES and 1 <= len(plans[4:]) <= 2
        assert all(p.startswith("optimal @ ") for p in plans[4:])
    for r in data["rows"]:
        assert r["grads_ok"] and r["grads_identical"] and r["grad_max_abs_diff"] == 0.0, r
        assert r["recompute_counts_match"] and "max_allocated_bytes" not in r
    nones = [r for r in data["rows"] if r["plan"] == "none"]
    assert all(r["tracker_error_pct"] == 0.0 for r in nones)  # no recomputation: the prediction is exact


def _measures_attention_core_and_the_peers(sections_: dict) -> None:
    core = sections_["attention_core"]["data"]
    assert core["fit"]["fits"] and core["row"]["dtype"] == "bfloat16" and core["row"]["identical"]
    assert core["row"]["stored_core"] < core["row"]["stored_base"] and core["row"]["stored_change_pct"] < 0
    peers = sections_["peers"]["data"]
    names = [r["name"] for r in peers["eager"]["rows"]]
    assert {"none", "per-block checkpoint", "checkpoint_sequential sqrt(N)"} <= set(names)
    assert any(n.startswith("remat") for n in names)
    assert all(r["identical"] for r in peers["eager"]["rows"] if r["step_ms"] is not None)
    assert {m["peer"] for m in peers["eager"]["matches"]} >= {"per-block checkpoint", "checkpoint_sequential sqrt(N)"}
    assert "skipped" in peers["compiled"]


def _estimates_what_it_measures(data: dict) -> None:
    """On the CPU the estimate traces the CPU's kernels: the built-in GPT's step without
    recomputation equals its measurement to the byte (with every block recomputed the estimate
    equals remat's prediction, and the measured step is within 0.02 % of it)."""
    expected = ["gpt"] + (["hf:llama"] if not data["skipped_models"] else [])
    assert [(r["model"], r["strategy"]) for r in data["rows"]] == [(m, s) for m in expected for s in ("none", "full")]
    assert all(r["kernels"] == "CPU" and r["measured_peak_bytes"] > 0 for r in data["rows"])
    gpt = [r["peak_error_pct"] for r in data["rows"] if r["model"] == "gpt"]
    assert gpt[0] == 0.0 and abs(gpt[1]) < 0.02
    assert all(abs(r["peak_error_pct"]) < 1.0 for r in data["rows"])


def _times_segments_of_every_length(data: dict) -> None:
    (row,) = data["rows"]
    assert row["model"] == "convnet" and row["blocks"] == 4 and data["failed_models"] == {}
    assert list(row["measured_ms"]) == ["none", "torch, 1 a segment (4 calls)", "torch, 2 a segment (2 calls)",
                                        "torch, 4 a segment (1 calls)", "remat full", "remat sqrt"]
    assert row["predicted_ms"]["full"] > row["predicted_ms"]["none"] > 0


def _writes_markdown_with_date_device_and_torch(results: dict, text: str) -> None:
    env = results["environment"]
    assert text.startswith(f"## Device check: {env['device_name']}, torch {torch.__version__}, {env['date_utc']}")
    for heading in ("### Predicted against measured, per model", "### Attention-core at a GPT-3 layer",
                    "### `remat estimate` against the measured step", "### remat against the alternatives at matched peaks",
                    "### Segments of k blocks, side by side (`benchmarks/segment_calls.py`)"):
        assert heading in text
    assert "| gpt | none |" in text and "| host_offload | skipped |" in text and "| remat sqrt |" in text


def _section(name, run, share=1.0):
    return sections.Section(name=name, share=share, run=run)


def test_a_section_out_of_time_keeps_what_it_finished_and_the_next_runs():
    def slow(data, progress):
        data["first"] = 1
        while True:
            time.sleep(0.01)

    def quick(data, progress):
        data["done"] = True

    written = []
    results = sections.run_sections([_section("slow", slow), _section("quick", quick)], 0.4, lambda m: None,
                                    lambda r: written.append(list(r)))
    assert results["slow"]["status"] == "timed out" and results["slow"]["data"] == {"first": 1}
    assert "ran out" in results["slow"]["note"]
    assert results["quick"]["status"] == "ok" and results["quick"]["data"] == {"done": True}
    assert written == [["slow"], ["slow", "quick"]]  # the files are rewritten after every section


def test_a_failing_or_skipped_section_says_why_and_loses_nothing_else():
    def broken(data, progress):
        data["rows"] = [1]
        raise RuntimeError("kernel exploded")

    def not_here(data, progress):
        raise sections.Skipped("needs CUDA")

    results = sections.run_sections([_section("broken", broken), _section("not_here", not_here)], 10.0,
                                    lambda m: None, lambda r: None)
    assert results["broken"]["status"] == "failed" and results["broken"]["data"] == {"rows": [1]}
    assert results["broken"]["note"].startswith("RuntimeError: kernel exploded")
    assert (results["not_here"]["status"], results["not_here"]["note"]) == ("skipped", "needs CUDA")


def test_the_time_limit_is_not_swallowed_by_a_harness_that_records_failures():
    def tolerant(data, progress):
        for i in range(1000):
            try:  # as benchmarks._peers.suite.try_add records a strategy that raises and goes on
                time.sleep(0.01)
            except Exception:
                data.setdefault("swallowed", []).append(i)

    result = sections.run_sections([_section("tolerant", tolerant)], 0.2, lambda m: None, lambda r: None)["tolerant"]
    assert result["status"] == "timed out" and result["data"] == {} and result["seconds"] < 5


def test_a_failing_part_is_recorded_and_the_next_part_runs():
    def two_models(data, progress):
        failures = data.setdefault("failed_models", {})
        for name in ("broken", "fine"):
            data.setdefault("rows", []).extend(sections.run_part(failures, name, _rows_of, name) or [])
        sections.raise_failures(failures)

    result = sections.run_sections([_section("models", two_models)], 10.0, lambda m: None, lambda r: None)["models"]
    assert result["status"] == "failed" and result["data"]["rows"] == ["fine row"]
    assert result["note"].startswith("PartsFailed: 1 part(s) failed: broken (first: ValueError: no broken rows)")
    assert list(result["data"]["failed_models"]) == ["broken"]


def _rows_of(name: str) -> list[str]:
    if name == "broken":
        raise ValueError("no broken rows")
    return [f"{name} row"]


def test_time_left_unused_passes_to_the_sections_after():
    assert sections.limit_s(100.0, 0.3, 1.0) == pytest.approx(30.0)
    # the first section used 10 of its 30 s: the 90 s left are shared 0.15 : 0.55
    assert sections.limit_s(90.0, 0.15, 0.7) == pytest.approx(90.0 * 0.15 / 0.7)
    assert sections.limit_s(-5.0, 0.5, 1.0) == 0.0


def test_non_finite_numbers_become_null_and_are_listed(tmp_path):
    results = {"environment": {}, "sections": {}, "a": [1.0, float("nan")], "b": {"c": float("inf")}}
    bad = []
    assert device_check.finite(results, "$", bad) == {"environment": {}, "sections": {}, "a": [1.0, None], "b": {"c": None}}
    assert bad == ["$.a[1]", "$.b.c"]


MIB = 2**20


def _finished(data: dict) -> dict:
    return dict(status="ok", note="", seconds=1.0, limit_s=2.0, data=data)


def _cuda_results() -> dict:
    """What a CUDA run records for one model row and the host offload (numbers chosen by hand)."""
    env = dict(date_utc="2027-01-01 00:00 UTC", device="cuda", device_name="NVIDIA H200", device_memory_bytes=140 * 2**30,
               torch_version="2.11.0+cu130", cuda_version="13.0", python_version="3.12.3", num_threads=16,
               cpu_count=16, git_commit="abc1234", size="full", repeats=5, total_limit_s=360.0,
               command="python -m benchmarks.device_check --device cuda --out o")
    row = dict(model="gpt", plan="full", predicted_peak_bytes=100 * MIB, tracker_peak_bytes=101 * MIB,
               tracker_error_pct=1.0, predicted_step_ms=50.0, measured_step_ms=55.0, baseline_step_ms=40.0,
               predicted_overhead_pct=25.0, measured_overhead_pct=37.5, step_error_pct=None, baseline_drift_pct=0.0,
               grads_ok=True, grads_identical=False, grad_max_abs_diff=2e-6, tolerance=1e-5,
               recompute_counts_match=True, max_allocated_bytes=110 * MIB, max_reserved_bytes=128 * MIB,
               outside_bytes=6 * MIB, allocated_error_pct=4.0, reserved_error_pct=22.0)
    offload = dict(offloaded_bytes=512 * MIB, device_to_host_bytes_per_s=50e9, host_to_device_bytes_per_s=40e9,
                   probe_overlap_fraction=0.9, transfer_ms=24.2, added_ms=6.05, predicted_added_ms=2.4,
                   hidden_fraction=0.75, baseline_step_ms=30.0, measured_step_ms=36.05, predicted_step_ms=32.4,
                   paired_step_error_pct=11.3, baseline_peak_bytes=900 * MIB, measured_peak_bytes=400 * MIB,
                   predicted_peak_bytes=398 * MIB, grads_ok=True, grad_max_abs_diff=0.0)
    return {"environment": env, "elapsed_s": 3.0, "sections": {
        "models": _finished({"allocator": "measured", "rows": [row], "skipped_models": {}}),
        "host_offload": _finished({"row": offload})}}


def test_markdown_renders_the_cuda_figures():
    from benchmarks._device import report

    text = report.markdown(_cuda_results())
    assert text.startswith("## Device check: NVIDIA H200, torch 2.11.0+cu130, 2027-01-01 00:00 UTC")
    assert ("| gpt | full | 100.00 | 101.00 (+1.0%) | 110.00 (+4.0%) | 128.00 (+22.0%) | 50.0 / 55.0 | +25.0% / "
            "+37.5% | - | within tolerance (max abs diff 2.0e-06, allowed 1e-05) | as planned |") in text
    assert "gradients passed: 1 of 1; replays as planned: 1 of 1." in text
    # the H200's first run: every selective plan replayed other calls than planned (torch 2.11)
    results = _cuda_results()
    results["sections"]["models"]["data"]["rows"][0]["recompute_counts_match"] = False
    text = report.markdown(results)
    assert "allowed 1e-05) | NOT as planned |" in text and "replays as planned: 0 of 1." in text
    assert ("| 512.00 MiB | 50.0 / 40.0 | 24.2 ms | 6.0 / 2.4 ms | 75% | 90% | 30.0 / 36.0 / 32.4 | +11.3% | "
            "900.00 / 400.00 / 398.00 | passed (max abs diff 0.0e+00) |") in text


def test_markdown_says_which_model_and_which_peers_part_failed():
    from benchmarks._device import report

    results = _cuda_results()
    results["sections"]["models"]["data"]["failed_models"] = {"hf:llama": "OutOfMemoryError: CUDA out of memory\n..."}
    results["sections"]["peers"] = _finished({"eager": None, "failed_parts": {"eager": "RuntimeError: boom\n..."},
                                              "compiled": {"skipped": "--no-compile"}})
    text = report.markdown(results)
    assert "hf:llama: failed (OutOfMemoryError: CUDA out of memory)." in text
    assert "#### eager\n\nFailed: RuntimeError: boom" in text and "#### compiled\n\nNot run: --no-compile." in text


def test_results_json_is_written_even_when_a_table_cannot_be_rendered(tmp_path):
    results = _cuda_results()
    del results["sections"]["host_offload"]["data"]["row"]["transfer_ms"]
    device_check.write_results(tmp_path, results)
    assert json.loads((tmp_path / "results.json").read_text())["sections"]["models"]["status"] == "ok"
    assert "could not be rendered (KeyError: 'transfer_ms')" in (tmp_path / "results.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]  # no partial files left


def test_bad_arguments_are_refused(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(SystemExit):
        device_check.parse_args(["--device", "cpu", "--out", str(a_file)])
    assert "is a file; pass a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        device_check.parse_args(["--device", "cpu", "--out", str(tmp_path), "--repeats", "0"])
    assert "--repeats 0 must be > 0" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            device_check.parse_args(["--out", str(tmp_path)])  # the default device is cuda
        assert "device='cuda' is not available here" in capsys.readouterr().err


def test_command_line_overrides_the_preset(tmp_path):
    args = device_check.parse_args(["--device", "cpu", "--size", "small", "--out", str(tmp_path), "--repeats", "3",
                                    "--time-limit-s", "60", "--no-compile", "--sections", "models"])
    config = device_check.configure(args)
    assert (config.repeats, config.total_s, config.compile_budgets, args.sections) == (3, 60.0, (), ["models"])
    assert device_check.configure(device_check.parse_args(["--device", "cpu", "--out", str(tmp_path)])).size == "full"


def test_host_offload_is_refused_off_cuda_before_building():
    from benchmarks.offload import host_offload

    with pytest.raises(ValueError, match="offload:cpu moves CUDA tensors to pinned host memory; use a CUDA device"):
        host_offload({}, "cpu", repeats=1)


def test_state_bytes_counts_parameters_gradients_and_optimizer_state_once():
    model = nn.Linear(4, 4)  # 20 float32 parameters: 80 bytes
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    built = BuiltModel(model=model, batch=torch.ones(2, 4), loss_fn=None, optimizer=optimizer, name="toy")
    # parameters, gradients, exp_avg and exp_avg_sq: 80 bytes each; AdamW's step counts: 4 bytes per parameter tensor
    assert state_bytes(built, torch.device("cpu")) == 4 * 80 + 2 * 4
    assert state_bytes(built, torch.device("meta")) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="max_memory_allocated/reserved need a CUDA device")
def test_allocator_peak_of_a_plan_without_recomputation_is_near_the_prediction():
    import remat
    from remat.models import load_target

    sizes = dict(num_layers=2, d_model=64, num_heads=2, seq_len=64, batch_size=2, vocab_size=64)
    built = load_target("gpt", device="cuda", **sizes)
    plan = remat.plan(remat.profile(built.model, built.batch, built.loss_fn, built.optimizer), strategy="none")
    del built
    peaks = allocator_peaks("gpt", sizes, plan, device="cuda")
    assert peaks["max_reserved_bytes"] >= peaks["max_allocated_bytes"] > plan.prediction.peak_bytes // 2
    # the allocator rounds every block up to 512 bytes and sees kernels' own buffers: within 10 %
    assert abs(peaks["allocated_error_pct"]) <= 10.0
