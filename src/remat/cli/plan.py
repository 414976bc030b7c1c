"""`remat plan`: choose per block between keeping, recomputing and offloading under a budget."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from remat._units import format_bytes, in_unit, table_unit
from remat.cli._app import DEVICE_HELP, app, check_output_file, console
from remat.measure.types import Profile
from remat.plan.types import Plan, Segment

TUNE_HELP = ("Time the cost model's best plans and every recipe that fits side by side on the model; the fastest "
             "measured whose measured peak fits wins (needs --model).")
TUNE_STEPS_HELP = "With --tune: timed steps per candidate at most (interleaved rounds, medians)."
TUNE_SECONDS_HELP = "With --tune: no new round of timing once the rounds took this many seconds."
WORLD_SIZE_HELP = ("Plan one rank of N data-parallel ranks (torchrun), its model state sharded by --zero "
                   "(remat.distributed.shard_profile); apply the plan on every rank, then wrap the model.")
ZERO_HELP = ("With --world-size: 0 = DDP (its gradient buckets counted), 1 = + optimizer state sharded, "
             "2 = + gradients, 3 = + parameters (FSDP2 by the plan: remat.distributed.fully_shard_by_plan).")


@app.command("plan")
def plan_command(
    profile_path: Optional[Path] = typer.Argument(None, help="A profile JSON written by `remat profile --json`, or a model to profile first (as --model: a built-in name or path/to/file.py:build)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget: 6GiB, 750MB, 512MiB or 40% of the baseline peak."),
    strategy: str = typer.Option("optimal", "--strategy", "-s", help="none, full, every:K, sqrt, selective:<policy>, optimal."),
    head: Optional[str] = typer.Option(None, "--head", help="Head (output projection + loss): keep, recompute or chunked:<tokens>; "
                                       "default: optimal searches them, other strategies keep it."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the Plan as JSON here."),
    show_pareto: bool = typer.Option(False, "--pareto", help="Print the frontier of peak against step time instead."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Profile this built-in model first (gpt, mlp, convnet, unet...)."),
    layers: Optional[int] = typer.Option(None, help="Blocks of the built-in model."),
    d_model: Optional[int] = typer.Option(None, "--d-model", help="Width of the built-in model."),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    seq: Optional[int] = typer.Option(None, help="Sequence length."),
    batch: Optional[int] = typer.Option(None, help="Batch size."),
    seed: Optional[int] = typer.Option(None, help="Seed of the built-in model's weights and batch (default 0)."),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    tune: bool = typer.Option(False, "--tune", help=TUNE_HELP),
    tune_steps: int = typer.Option(20, "--tune-steps", help=TUNE_STEPS_HELP),
    tune_seconds: float = typer.Option(30.0, "--tune-seconds", help=TUNE_SECONDS_HELP),
    world_size: Optional[int] = typer.Option(None, "--world-size", help=WORLD_SIZE_HELP),
    zero: Optional[int] = typer.Option(None, "--zero", help=ZERO_HELP),
) -> None:
    """Plan the fastest step that fits the budget and print it per block, against the baseline."""
    from remat.plan.budget import parse_budget
    from remat.plan.planners import pareto, plan

    sizes = dict(layers=layers, d_model=d_model, heads=heads, seq=seq, batch=batch)
    if profile_path is not None and model is None and _names_a_model(profile_path):
        profile_path, model = None, str(profile_path)  # `remat plan my.py:build`, as `remat profile` takes it
    check_output_file(out, "--out")
    if show_pareto:
        given = [name for name, on in (("--budget", budget is not None), ("--out", out is not None), ("--tune", tune),
                                       ("--head", head is not None), ("--strategy", strategy != "optimal")) if on]
        if given:
            raise ValueError(f"--pareto prints every optimal plan from no recomputation to the least peak, so "
                             f"{', '.join(given)} would be ignored; drop --pareto to plan one (and write it), or "
                             f"drop {', '.join(given)}.")
    _check_sharding_options(world_size, zero, tune)
    if tune and model is None:
        raise ValueError("--tune times plans on the model, which a profile JSON does not hold: give --model NAME "
                         "(or use `remat run --tune`).")
    profile, built = _load_target(profile_path, model, sizes, seed, device)
    if world_size is not None:
        profile = sharded(profile, world_size, 0 if zero is None else zero)
    baseline = plan(profile, strategy="none")
    if show_pareto:
        console.print(pareto_table(pareto(profile), baseline))
        return
    # a percentage of one rank's predicted peak where sharded (the profile measured the unsharded step)
    reference = baseline.prediction.peak_bytes if world_size is not None else baseline_peak_of(profile, baseline)
    budget_bytes = None if budget is None else parse_budget(budget, reference)
    tuner = _tuner(built, tune_steps, tune_seconds) if tune else None
    with console.status("timing candidate plans...") if tune else contextlib.nullcontext():
        result = plan(profile, budget=budget_bytes, strategy=strategy, head=head, tune=tuner)
    if result.tuning is not None:
        print_tuning(result)
    console.print(plan_table(result, profile))
    if any(b.unavailable for b in profile.blocks):
        from remat.cli.profile import unavailable_rich

        console.print(unavailable_rich(profile))
    console.print(comparison(result, baseline))
    worse = no_gain_line(result, baseline)
    if worse:
        console.print(Text(worse, style="yellow"))
    if result.budget_bytes is not None:
        console.print(fit_line(result, baseline))
    if result.optimality is not None:
        console.print(optimality_line(result, baseline))
    if out is not None:
        result.save(out)
        console.print(f"plan written to {out}")


def _check_sharding_options(world_size: Optional[int], zero: Optional[int], tune: bool) -> None:
    if zero is not None and world_size is None:
        raise ValueError(f"--zero {zero} shards model state over data-parallel ranks: give their number with "
                         "--world-size N (the ranks of torchrun, each running the same model).")
    if world_size is not None and tune:
        raise ValueError(f"--tune times plans on this process's model, unsharded, where --world-size {world_size} plans "
                         "one rank of a sharded step: drop --tune, or time the plan on the ranks (remat.verify "
                         "on each rank under torchrun).")


def sharded(profile: Profile, world_size: int, zero: int) -> Profile:
    """One rank's view of ``profile`` over ``world_size`` data-parallel ranks under ZeRO-``zero``
    (`remat.distributed.shard_profile`); a profile that is one rank's already is refused."""
    from remat.distributed import shard_profile

    if profile.gathered_bytes or profile.unit_bytes or profile.bucket_bytes:
        raise ValueError("the profile is one rank's of a sharded step already (it holds what FSDP2 gathers or DDP's "
                         "buckets): drop --world-size and --zero, or plan on the profile of the unwrapped model.")
    return shard_profile(profile, world_size=world_size, zero_stage=zero)


def _tuner(built, max_steps: int, max_seconds: float):
    from remat.apply.tune import Tuner

    return Tuner(built.model, built.batch, built.loss_fn, built.optimizer, max_steps=max_steps, max_seconds=max_seconds)


def print_tuning(result: Plan) -> None:
    """The tuning table (predicted against measured per candidate, the winner marked) and its sentence."""
    from remat.report.tuning import tuning_sentence, tuning_table

    (headers, rows), winner = tuning_table(result.tuning)
    table = Table(title="measured tuning: candidates timed side by side")
    for header in headers:
        table.add_column(header, justify="left" if header in ("candidate", "layout", "result") else "right")
    for i, row in enumerate(rows):
        table.add_row(*row, style="bold green" if i == winner else None)
    console.print(table)
    console.print(tuning_sentence(result.tuning))


def _load_target(path: Optional[Path], model: Optional[str], sizes: dict, seed: Optional[int],
                 device: Optional[str] = None):
    """The profile, and the built model when ``--model`` was given (else None)."""
    if path is not None:
        if model is not None or device is not None:
            raise ValueError("give either a profile JSON or --model (and --device), not both.")
        given = [f"--{name.replace('_', '-')}" for name, value in {**sizes, "seed": seed}.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to the model remat profiles with "
                             f"--model; the profile {str(path)!r} was measured on its model as it was: drop "
                             f"{', '.join(given)}, or profile again with --model.")
        return Profile.load(path), None
    if model is None:
        raise ValueError("give a profile JSON (remat profile --json p.json) or --model NAME to profile first.")
    from remat.measure.profile import profile
    from remat.models import load_target, sizes_from_options

    with console.status(Text(f"profiling {model}...")):
        built = load_target(model, seed=seed or 0, device=device, **sizes_from_options(model, **sizes))
        return profile(built.model, built.batch, built.loss_fn, built.optimizer), built


def _names_a_model(path: Path) -> bool:
    """Whether the positional argument of `remat plan`, which is no file, names a model to profile: a
    built-in model or ``file.py:function`` of a file that exists."""
    from remat.models import MODEL_NAMES
    from remat.models.loading import is_file_target

    spec = str(path)
    if path.exists():
        return False
    if spec in MODEL_NAMES:
        return True
    return is_file_target(spec) and Path(spec.rsplit(":", 1)[0]).is_file()


def baseline_peak_of(profile: Profile, baseline: Plan) -> int:
    """The baseline peak a percentage budget refers to: measured when the profile has it."""
    return profile.peak_bytes if profile.peak_bytes > 0 else baseline.prediction.peak_bytes



def describe(segment: Segment) -> str:
    """``recompute [0, 4) > [0, 2)``-style text of a segment and its nesting."""
    if segment.kind == "selective":
        return f"{segment.strategy} ({len(segment.saved_ops)} ops saved)"
    if segment.kind != "recompute" or segment.num_blocks == 1 and not segment.children:
        return segment.strategy
    text = f"recompute [{segment.start}, {segment.stop})"
    if segment.children:
        text += " { " + ", ".join(describe(c) for c in segment.children) + " }"
    return text


def plan_table(result: Plan, profile: Profile) -> Table:
    """One row per top-level segment: blocks, strategy, bytes held, recompute time."""
    from remat.plan.predict import predict

    budget = "no budget" if result.budget_bytes is None else f"budget {format_bytes(result.budget_bytes)}"
    table = Table(title=f"remat plan: {result.strategy_name}, {budget}")
    unit, size = table_unit([sum(result.prediction.retained_bytes[s.start : s.stop]) for s in result.segments])
    for header in ("blocks", "names", "strategy", f"held {unit}", "extra ms"):
        table.add_column(header, justify="left" if header in ("names", "strategy") else "right")
    for seg in result.segments:
        alone = predict(profile, _keep_except(profile, seg))
        names = result.block_names[seg.start] + ("" if seg.num_blocks == 1 else f" .. {result.block_names[seg.stop - 1]}")
        held = sum(result.prediction.retained_bytes[seg.start : seg.stop])
        table.add_row(f"{seg.start}" if seg.num_blocks == 1 else f"{seg.start}-{seg.stop - 1}", names, describe(seg),
                      in_unit(held, size), f"{alone.extra_ms:.2f}")
    return table


def _keep_except(profile: Profile, seg: Segment) -> tuple[Segment, ...]:
    keep = [Segment(start=i, stop=i + 1, strategy="keep") for i in range(profile.num_blocks)]
    return tuple(keep[: seg.start] + [seg] + keep[seg.stop :])


def comparison(result: Plan, baseline: Plan) -> Table:
    """Predicted peak, step time and FLOPs of the plan against no recomputation."""
    p, b = result.prediction, baseline.prediction
    table = Table(title="prediction against the baseline (no recomputation)")
    for header in ("", "baseline", "plan", "change"):
        table.add_column(header, justify="right")
    unit, size = table_unit([b.peak_bytes, p.peak_bytes])
    table.add_row(f"peak {unit}", in_unit(b.peak_bytes, size), in_unit(p.peak_bytes, size), f"{100 * (p.peak_bytes / b.peak_bytes - 1):+.1f}%")
    table.add_row("step ms", f"{b.step_ms:.2f}", f"{p.step_ms:.2f}", f"{100 * (p.step_ms / b.step_ms - 1):+.1f}%")
    table.add_row("extra GFLOPs", "0", f"{p.extra_flops / 1e9:.3f}", "")
    where = f"block {p.peak_block}" if p.peak_phase == "block" else p.peak_phase
    table.add_row("peak at", b.peak_phase if b.peak_phase != "block" else f"block {b.peak_block}", where, "")
    table.add_row("head", baseline.head, result.head, "" if result.head == "keep" else "no logits returned")
    return table


def no_gain_line(result: Plan, baseline: Plan) -> str:
    """'' unless a plan that recomputes is predicted to hold no less than no recomputation: a
    fixed layout (``sqrt`` on two blocks makes one segment of both, whose replay holds them
    together) can; the optimal search under a budget never returns one."""
    p, b = result.prediction, baseline.prediction
    if p.extra_ms <= 0 and p.extra_flops == 0 or p.peak_bytes < b.peak_bytes:
        return ""
    return (f"this {result.strategy_name} plan is predicted to peak at {format_bytes(p.peak_bytes)}, no lower "
            f"than no recomputation ({format_bytes(b.peak_bytes)}), and to run slower: plan with a budget "
            "(--budget, the optimal strategy) for a plan that lowers the peak.")


def fit_line(result: Plan, baseline: Plan) -> str:
    """The plan against its budget and the baseline, in words (`plan` refuses a plan that does not fit)."""
    p, b = result.prediction, baseline.prediction
    return (f"predicted peak {format_bytes(p.peak_bytes)} fits the budget of {format_bytes(result.budget_bytes)} "
            f"({100 * (1 - p.peak_bytes / b.peak_bytes):.0f}% below no recomputation) "
            f"at {100 * (p.step_ms / b.step_ms - 1):+.1f}% predicted step time.")


def optimality_line(result: Plan, baseline: Plan) -> str:
    """How far the optimal plan may be from the fastest that fits its budget, in words."""
    o = result.optimality
    if o.exact and o.quantum_bytes == 1:
        return "no plan of the search space that fits the budget is predicted faster (memory counted in bytes)."
    step = baseline.prediction.step_ms
    return (f"at most {o.gap_ms:.2f} ms ({100 * o.gap_ms / step:.2f}% of the baseline step) slower than the fastest "
            f"plan that fits (memory counted in slots of {o.quantum_bytes} bytes).")


def pareto_table(frontier: list[Plan], baseline: Plan, max_rows: int = 24) -> Table:
    """The frontier: each row is the fastest plan at its predicted peak (at most ``max_rows``
    rows, evenly spread, both ends kept)."""
    shown = _spread(len(frontier), max_rows)
    title = "remat plan --pareto: fastest plan at each predicted peak"
    if len(shown) < len(frontier):
        title += f" ({len(shown)} of {len(frontier)} frontier plans)"
    table = Table(title=title)
    unit, size = table_unit([frontier[i].prediction.peak_bytes for i in shown])
    for header in ("#", f"peak {unit}", "step ms", "overhead", "strategies"):
        table.add_column(header, justify="left" if header == "strategies" else "right")
    for i in shown:
        item = frontier[i]
        counts = Counter(_top_kind(s) for s in item.segments for _ in range(s.num_blocks))
        summary = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) + ("" if item.head == "keep" else f"; head {item.head}")
        overhead = 100 * (item.prediction.step_ms / baseline.prediction.step_ms - 1)
        table.add_row(str(i), in_unit(item.prediction.peak_bytes, size), f"{item.prediction.step_ms:.2f}", f"{overhead:+.1f}%", summary)
    return table


def _spread(count: int, max_rows: int) -> list[int]:
    if count <= max_rows:
        return list(range(count))
    return sorted({round(k * (count - 1) / (max_rows - 1)) for k in range(max_rows)})


def _top_kind(segment: Segment) -> str:
    if segment.kind == "recompute" and segment.children:
        return "recompute (nested)"
    return segment.strategy
