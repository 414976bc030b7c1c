"""The report's tables as plain rows of strings: plans, blocks, verifications, environment.

Each function returns ``(headers, rows)``; the HTML page renders them, and so can a terminal.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.report.summary import baseline_point, find_verification, plan_label
from remat.report.units import format_bytes, format_flops, format_ms, format_pct
from remat.verify_types import Verification

Table = tuple[tuple[str, ...], list[tuple[str, ...]]]

PLAN_HEADERS = ("plan", "predicted peak", "fits budget", "predicted step", "vs no recomputation",
                "extra per step", "offloaded", "peak set by", "measured peak", "measured step")


def plans_table(profile: Profile, plans: Sequence[Plan], verifications: Sequence[Verification],
                budget_bytes: int | None) -> Table:
    """One row per plan: prediction, whether it fits, and what verify measured."""
    base = baseline_point(profile, plans)
    rows = [_plan_row(profile, p, base.step_ms, budget_bytes, find_verification(p, verifications))
            for p in plans]
    fits = f"fits {format_bytes(budget_bytes)}" if budget_bytes is not None else "fits budget"
    return tuple(fits if h == "fits budget" else h for h in PLAN_HEADERS), rows


def _plan_row(profile: Profile, plan: Plan, base_ms: float, budget: int | None,
              ver: Verification | None) -> tuple[str, ...]:
    pred = plan.prediction
    fits = "-" if budget is None else ("yes" if pred.peak_bytes <= budget else "no")
    overhead = format_pct(100.0 * (pred.step_ms / base_ms - 1.0)) if base_ms > 0 else "-"
    recompute = (f"{format_flops(pred.extra_flops)}, {format_ms(pred.extra_ms)}"
                 if pred.extra_flops or pred.extra_ms else "none")
    measured_peak = "-" if ver is None else (
        f"{format_bytes(ver.measured_peak_bytes)} ({format_pct(ver.peak_error_pct)})")
    measured_step = "-" if ver is None else (
        f"{format_ms(ver.measured_step_ms)} ({format_pct(ver.paired_step_error_pct)} side by side)")
    return (plan_label(plan), format_bytes(pred.peak_bytes), fits, format_ms(pred.step_ms), overhead,
            recompute, format_bytes(pred.offloaded_bytes), _peak_where(profile, plan),
            measured_peak, measured_step)


def _peak_where(profile: Profile, plan: Plan) -> str:
    pred = plan.prediction
    if pred.peak_block >= 0 and pred.peak_block < profile.num_blocks:
        return f"{profile.blocks[pred.peak_block].name} ({pred.peak_phase})"
    return pred.peak_phase


def blocks_table(profile: Profile, plans: Sequence[Plan]) -> Table:
    """One row per block: its measurements, then its strategy under each plan."""
    headers = ("block", "#", "class", "saved", "input", "fwd", "bwd", "fwd FLOPs",
               *(plan_label(p) for p in plans))
    strategies = [p.block_strategies() for p in plans]
    rows = [
        (b.name, str(b.index), b.class_name, format_bytes(b.saved_bytes), format_bytes(b.input_bytes),
         format_ms(b.fwd_ms), format_ms(b.bwd_ms), format_flops(b.fwd_flops),
         *(s[b.index] for s in strategies))
        for b in profile.blocks
    ]
    return headers, rows


def unavailable_table(profile: Profile) -> Table:
    """One row per strategy a block cannot run and why (what its probe raised in the profile);
    no rows when every block can run every strategy."""
    rows = [(b.name, str(b.index), strategy, reason) for b in profile.blocks for strategy, reason in b.unavailable]
    return ("block", "#", "strategy", "why it cannot run there"), rows


VERIFICATION_HEADERS = ("plan", "gradients", "max |grad diff|", "max |loss diff|", "recompute counts",
                        "measured peak", "predicted peak", "peak error", "measured step",
                        "predicted step", "overhead predicted", "overhead measured", "step error (side by side)",
                        "baseline vs profile")


def verifications_table(verifications: Sequence[Verification]) -> Table:
    """One row per verification: equality of gradients, measured against predicted."""
    rows = [
        (v.strategy_name + (f" @ {format_bytes(v.budget_bytes)}" if v.budget_bytes is not None else ""),
         _grad_verdict(v), f"{v.grad_max_abs_diff:.3g}", f"{v.loss_max_abs_diff:.3g}",
         "as planned" if v.recompute_counts_match else "MISMATCH",
         format_bytes(v.measured_peak_bytes), format_bytes(v.predicted_peak_bytes),
         format_pct(v.peak_error_pct), format_ms(v.measured_step_ms), format_ms(v.predicted_step_ms),
         format_pct(v.predicted_overhead_pct), format_pct(v.overhead_pct), format_pct(v.paired_step_error_pct),
         format_pct(v.baseline_drift_pct))
        for v in verifications
    ]
    return VERIFICATION_HEADERS, rows


def op_mismatch_table(verifications: Sequence[Verification]) -> Table:
    """Ops whose planned call count differs from what the plan predicts (none when all match)."""
    rows = [(v.strategy_name, c.block, c.op, str(c.baseline_count), str(c.planned_count), str(c.expected_count))
            for v in verifications for c in v.op_counts if c.planned_count != c.expected_count]
    return ("plan", "block", "op", "baseline calls", "planned calls", "expected calls"), rows


def _grad_verdict(ver: Verification) -> str:
    if ver.nonfinite:
        return f"DIFFER: NaN or Inf in {len(ver.nonfinite)} tensor(s), first: {ver.nonfinite[0]}"
    if ver.grads_identical:
        return "bit-identical"
    if ver.ok and ver.relative_tolerance:
        return f"within relative tolerance {ver.relative_tolerance:.1e}: max {ver.grad_max_rel_diff:.1e} ({ver.tolerance_reason})"
    if ver.ok:
        return f"within tolerance {ver.tolerance:.1e} ({ver.tolerance_reason})"
    return f"DIFFER beyond tolerance {ver.tolerance:.1e}"


def environment_table(profile: Profile) -> Table:
    """Where and on what the profile was measured."""
    env, fp, bw = profile.environment, profile.fingerprint, profile.bandwidths
    rows = [
        ("device", f"{fp.device}: {env.device_name}"),
        ("torch", fp.torch_version),
        ("python", env.python_version),
        ("host", env.hostname),
        ("threads", str(env.num_threads)),
        ("parameter dtype", fp.dtype),
        ("batch", ", ".join(fp.batch_shapes)),
        ("model hash", fp.model_hash),
        ("blocks", f"{profile.num_blocks} x {_block_classes(profile)}"),
        ("optimizer", profile.optimizer_name),
        ("parameters / gradients / optimizer state",
         f"{format_bytes(profile.param_bytes)} / {format_bytes(profile.gradient_bytes)} / "
         f"{format_bytes(profile.optimizer_state_bytes)}"),
        ("measured baseline step", f"{format_ms(profile.step_ms)}, peak {format_bytes(profile.peak_bytes)}"),
    ]
    if profile.device_max_allocated_bytes is not None:
        rows.append(("device max allocated (baseline)", format_bytes(profile.device_max_allocated_bytes)))
    rows += _bandwidth_rows(bw)
    return ("", ""), rows


def _block_classes(profile: Profile) -> str:
    return ", ".join(dict.fromkeys(b.class_name for b in profile.blocks)) or "-"


def _bandwidth_rows(bw) -> list[tuple[str, str]]:
    rates = (("host to device", bw.host_to_device_bytes_per_s), ("device to host", bw.device_to_host_bytes_per_s),
             ("disk write", bw.disk_write_bytes_per_s), ("disk read", bw.disk_read_bytes_per_s))
    return [(f"{name} bandwidth", f"{format_bytes(rate)}/s") for name, rate in rates if rate is not None]
