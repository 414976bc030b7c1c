"""``results.md``: the device check's results as Markdown, ready to paste into BENCHMARKS.md.

Rendered from the same dict that goes to ``results.json`` (so a partial run renders what it
has): a header with the date, the device and the torch version, a line per section with its
status, then a table per section that measured something.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MIB = 2**20
GIB = 2**30


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mib(value: int | None) -> str:
    return _num(None if value is None else value / MIB, ".2f")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _with_error(nbytes: int | None, error_pct: float | None) -> str:
    return "CUDA only" if nbytes is None else f"{nbytes / MIB:.2f} ({_num(error_pct, '+.1f', '%')})"


def _grads(row: dict[str, Any]) -> str:
    if row["grads_identical"]:
        return "identical"
    verdict = "within tolerance" if row["grads_ok"] else "DIFFER"
    return f"{verdict} (max abs diff {_num(row['grad_max_abs_diff'], '.1e')}, allowed {row['tolerance']:g})"


def _replays(row: dict[str, Any]) -> str:
    """Whether each block replayed the op calls its plan names (`Verification.recompute_counts_match`):
    a selective policy that answers the replay differently from the forward replays more."""
    match = row.get("recompute_counts_match")
    return "-" if match is None else "as planned" if match else "NOT as planned"


def _within(value: float | None, limit: float) -> bool:
    return value is not None and abs(value) <= limit


def header(results: dict[str, Any]) -> str:
    env = results["environment"]
    cuda = f", CUDA {env['cuda_version']}" if env.get("cuda_version") else ""
    lines = [
        f"## Device check: {env['device_name']}, torch {env['torch_version']}, {env['date_utc']}",
        "",
        f"`{env['command']}` (size {env['size']}, {env['repeats']} timed pairs a plan); {env['device_name']} "
        f"({env['device_memory_bytes'] / GIB:.1f} GiB), torch {env['torch_version']}{cuda}, Python "
        f"{env['python_version']}, {env['cpu_count']} CPU cores, {env['num_threads']} threads; commit "
        f"{env.get('git_commit') or 'unknown'}; sections {results.get('elapsed_s', 0.0):.0f} s of "
        f"{env['total_limit_s']:.0f} s allowed.",
        "",
        "| section | status | seconds (limit) | note |",
        "| --- | --- | ---: | --- |",
    ]
    for name, section in results["sections"].items():
        note = section["note"].splitlines()[0] if section["note"] else ""
        lines.append(f"| {name} | {section['status']} | {section['seconds']:.0f} ({section['limit_s']:.0f}) | {note} |")
    return "\n".join(lines)


def models_table(data: dict[str, Any]) -> str:
    rows = data.get("rows", [])
    lines = [
        "| model | plan | peak predicted MiB | tracker MiB (error) | max allocated MiB (error) | max reserved MiB "
        "(error) | step ms predicted / measured | overhead predicted / measured | step error (side by side) | gradients "
        "| replayed calls |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['plan']} | {_mib(r['predicted_peak_bytes'])} | "
            f"{_with_error(r['tracker_peak_bytes'], r['tracker_error_pct'])} | "
            f"{_with_error(r.get('max_allocated_bytes'), r.get('allocated_error_pct'))} | "
            f"{_with_error(r.get('max_reserved_bytes'), r.get('reserved_error_pct'))} | "
            f"{_num(r['predicted_step_ms'], '.1f')} / {_num(r['measured_step_ms'], '.1f')} | "
            f"{_num(r['predicted_overhead_pct'], '+.1f', '%')} / {_num(r['measured_overhead_pct'], '+.1f', '%')} | "
            f"{_num(r['step_error_pct'], '+.1f', '%')} | {_grads(r)} | {_replays(r)} |"
        )
    planned = [r for r in rows if r["plan"] != "none"]
    peaks = sum(_within(r["tracker_error_pct"], 2) for r in rows)
    steps = sum(_within(r["step_error_pct"], 10) for r in planned)
    lines += ["", f"Peak within 2 % (tracker): {peaks} of {len(rows)}; step time within 10 % side by side: "
                  f"{steps} of {len(planned)} plans; gradients passed: {sum(r['grads_ok'] for r in rows)} of {len(rows)}; "
                  f"replays as planned: {sum(r.get('recompute_counts_match') is not False for r in rows)} of {len(rows)}. "
                  f"Allocator: {data.get('allocator', '-')}; its errors are of the allocator's figure less what "
                  "lies outside the model state (batch, library workspaces)."]
    lines += [f"{name}: skipped ({why})." for name, why in data.get("skipped_models", {}).items()]
    lines += [f"{name}: failed ({why.splitlines()[0]})." for name, why in data.get("failed_models", {}).items()]
    return "\n".join(lines)


def attention_core_table(data: dict[str, Any], repeats: int) -> str:
    from benchmarks import attention_core

    row, fit = data["row"], data["fit"]
    verdict = "met" if data["target_met"] else "missed"
    return "\n".join([
        attention_core.markdown([row], repeats),
        "",
        f"Target: stored activations {row['stored_change_pct']:+.0f}% (at most -65%) at {row['overhead']:+.1f}% step "
        f"time (at most +5%): {verdict}. The shape needs about {_size(fit['needed_bytes'])} with three copies "
        f"under remat.verify (remat estimate: {_size(fit['estimated_peak_bytes'])} a copy's step); the device "
        f"has {_size(fit['device_memory_bytes'])}.",
    ])


def _pct_of(fraction: float | None) -> str:
    return _num(None if fraction is None else 100 * fraction, ".0f", "%")


def host_offload_table(row: dict[str, Any]) -> str:
    gbps = {k: _num(row[k] and row[k] / 1e9, ".1f") for k in ("device_to_host_bytes_per_s", "host_to_device_bytes_per_s")}
    ms = {k: _num(row[k], ".1f") for k in ("transfer_ms", "added_ms", "predicted_added_ms", "baseline_step_ms",
                                           "measured_step_ms", "predicted_step_ms")}
    return "\n".join([
        "| offloaded per step | device->host / host->device GB/s | transfer at those rates | step time added: "
        "measured / predicted | transfer hidden (achieved) | probe's overlap | step ms: none / offload / predicted "
        "| step error (side by side) | peak MiB: none / offload / predicted | gradients |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {_mib(row['offloaded_bytes'])} MiB | {gbps['device_to_host_bytes_per_s']} / "
        f"{gbps['host_to_device_bytes_per_s']} | {ms['transfer_ms']} ms | {ms['added_ms']} / "
        f"{ms['predicted_added_ms']} ms | {_pct_of(row['hidden_fraction'])} | {_pct_of(row['probe_overlap_fraction'])} | "
        f"{ms['baseline_step_ms']} / {ms['measured_step_ms']} / {ms['predicted_step_ms']} | "
        f"{_num(row['paired_step_error_pct'], '+.1f', '%')} | {_mib(row['baseline_peak_bytes'])} / "
        f"{_mib(row['measured_peak_bytes'])} / {_mib(row['predicted_peak_bytes'])} | "
        f"{'passed' if row['grads_ok'] else 'DIFFER'} (max abs diff {_num(row['grad_max_abs_diff'], '.1e')}) |",
        "",
        "Target: the offload hides at least 80 % of its transfer time.",
    ])


def estimate_table(data: dict[str, Any]) -> str:
    rows = data.get("rows", [])
    lines = ["| model | strategy | kernels | peak estimated MiB | peak measured MiB (tracker) | error "
             "| step ms estimated (MFU) / measured |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['strategy']} | {r['kernels']} | {_mib(r['estimated_peak_bytes'])} | "
                     f"{_mib(r['measured_peak_bytes'])} | {_num(r['peak_error_pct'], '+.2f', '%')} | "
                     f"{_num(r['estimated_step_ms'], '.1f')} ({_num(r['mfu'], '.2f')}) / {_num(r['measured_step_ms'], '.1f')} |")
    within = sum(_within(r["peak_error_pct"], 2) for r in rows)
    lines += ["", f"Estimated peak within 2 % of the measured: {within} of {len(rows)}. The estimate's step time "
                  "is its FLOP count at the stated MFU of an H200's peak rate, not a measurement."]
    lines += [f"{name}: skipped ({why})." for name, why in data.get("skipped_models", {}).items()]
    lines += [f"{name}: failed ({why.splitlines()[0]})." for name, why in data.get("failed_models", {}).items()]
    return "\n".join(lines)


def segments_table(data: dict[str, Any]) -> str:
    """Per model: what the profile charges a segment boundary, then each run's median step."""
    lines = []
    for row in data.get("rows", []):
        predicted = " / ".join(f"{row['predicted_ms'][s]:.1f}" for s in ("none", "full", "sqrt"))
        lines += [f"{row['model']}, {row['blocks']} blocks ({', '.join(f'{k}={v}' for k, v in row['sizes'].items())}): "
                  f"the profile's checkpointed call {row['checkpoint_call_ms']:.3f} ms and block 0's overhead "
                  f"{row['block0_recompute_overhead_ms']:.3f} ms (forward {row['block0_fwd_ms']:.2f} ms, backward "
                  f"{row['block0_bwd_ms']:.2f} ms); predicted none / full / sqrt {predicted} ms.", "",
                  "| run | step ms (median) | against none |", "| --- | ---: | ---: |"]
        none = row["measured_ms"]["none"]
        lines += [f"| {key} | {ms:.1f} | {100 * (ms / none - 1):+.1f}% |" for key, ms in row["measured_ms"].items()]
        lines.append("")
    lines += [f"{name}: failed ({why.splitlines()[0]})." for name, why in data.get("failed_models", {}).items()]
    return "\n".join(lines).strip()


def _peers_part(part: dict[str, Any]) -> str:
    from benchmarks._peers import results

    if "skipped" in part:
        return f"Not run: {part['skipped']}."
    rows = [results.Row(**r) for r in part["rows"]]
    fields = {f.name for f in dataclasses.fields(results.Match)}
    matches = [results.Match(**{k: v for k, v in m.items() if k in fields}) for m in part["matches"]]
    sizes = ", ".join(f"{k}={v}" for k, v in part["sizes"].items())
    return "\n\n".join([f"GPT, {part['num_blocks']} blocks ({sizes}):", results.strategy_table(rows),
                        "remat against each peer at a peak no larger than the peer's:", results.match_table(matches)])


def peers_tables(data: dict[str, Any]) -> str:
    parts = []
    for mode in ("eager", "compiled"):
        failed = data.get("failed_parts", {}).get(mode)
        if data.get(mode) or failed:
            body = _peers_part(data[mode]) if data.get(mode) else f"Failed: {failed.splitlines()[0]}"
            parts.append(f"#### {mode}\n\n{body}")
    return "\n\n".join(parts)


def markdown(results: dict[str, Any]) -> str:
    """The whole ``results.md``."""
    sections = results["sections"]
    out = [header(results)]
    render = {
        "models": ("Predicted against measured, per model",
                   lambda d: models_table(d) if d.get("rows") or d.get("failed_models") else None),
        "attention_core": ("Attention-core at a GPT-3 layer",
                           lambda d: attention_core_table(d, results["environment"]["repeats"]) if "row" in d else None),
        "host_offload": ("Pinned host offload (offload:cpu, every block)",
                         lambda d: host_offload_table(d["row"]) if "row" in d else None),
        "estimate": ("`remat estimate` against the measured step",
                     lambda d: estimate_table(d) if d.get("rows") or d.get("failed_models") else None),
        "segments": ("Segments of k blocks, side by side (`benchmarks/segment_calls.py`)",
                     lambda d: segments_table(d) if d.get("rows") or d.get("failed_models") else None),
        "peers": ("remat against the alternatives at matched peaks", lambda d: peers_tables(d) or None),
    }
    for name, (title, table) in render.items():
        body = table(sections[name]["data"]) if name in sections else None
        if body:
            out.append(f"### {title}\n\n{body}")
    return "\n\n".join(out) + "\n"
