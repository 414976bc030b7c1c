"""Live demonstrations: each quiz answer measured on this machine by remat's own stages.

Every demonstration builds a small built-in model (`remat.models.build`), runs it through
remat (profile, plan, predict, apply_, verify, disk offload) and returns a `Demonstration`:
the numbers, and whether the claim the answer makes holds here. Each takes a few seconds on
2 CPU cores. Nothing here prints; the ``remat quiz --live`` command renders the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from remat._batch import forward_backward, model_device

KIB = 1024


@dataclass(kw_only=True, frozen=True)
class Row:
    """One line of a demonstration's table."""

    label: str
    """Key of the line's label in the quiz data (``live_labels``), translated by the renderer."""
    value: str
    """The formatted measurement, e.g. ``"3,080.0 KiB"``."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Values the label template formats, e.g. ``{"block": "blocks.0"}``."""


def _row(label: str, value: str, **fields: Any) -> Row:
    return Row(label=label, value=value, fields=fields)


@dataclass(kw_only=True, frozen=True)
class Demonstration:
    """What one live measurement found."""

    question_id: str
    """The question it backs (`remat.quiz.content.Question.id`)."""
    values: Mapping[str, Any]
    """The measured numbers (and short names) the question's ``live_claim`` template formats."""
    holds: bool
    """Whether the answer's claim holds in this measurement."""
    rows: tuple[Row, ...] = field(default_factory=tuple)
    """One formatted value per measured quantity, for a table."""


DEMONSTRATIONS: dict[str, Callable[[], Demonstration]] = {}
"""Question id -> the function that measures it."""


def demonstration(question_id: str) -> Callable[[Callable[[], Demonstration]], Callable[[], Demonstration]]:
    """Register a demonstration for the question ``question_id``."""

    def register(fn: Callable[[], Demonstration]) -> Callable[[], Demonstration]:
        DEMONSTRATIONS[question_id] = fn
        return fn

    return register


def demonstrate(question_id: str) -> Demonstration:
    """Run the live measurement for ``question_id``."""
    fn = DEMONSTRATIONS.get(question_id)
    if fn is None:
        raise LookupError(
            f"no live measurement for question {question_id!r}; available: {', '.join(sorted(DEMONSTRATIONS)) or 'none'}."
        )
    with torch.random.fork_rng(devices=[]):
        return fn()


# ---------------------------------------------------------------- the stages, as the quiz uses them


@dataclass(kw_only=True, frozen=True)
class _Job:
    """A built-in model with its batch, loss and optimizer, and its profile."""

    built: Any
    """`remat.models.BuiltModel`."""
    profile: Any
    """`remat.Profile` of it."""

    @property
    def model(self) -> nn.Module:
        return self.built.model


# The stages are imported from their modules: the attribute ``remat.plan`` becomes the
# subpackage ``remat.plan`` once that is imported, and likewise ``remat.verify``.


def _job(name: str, *, repeats: int = 3, **sizes: Any) -> _Job:
    from remat.measure.profile import profile
    from remat.models import build

    built = build(name, seed=0, **sizes)
    prof = profile(built.model, built.batch, loss_fn=built.loss_fn, optimizer=built.optimizer, repeats=repeats)
    return _Job(built=built, profile=prof)


def _plan(job: _Job, strategy: str, budget: int | None = None) -> Any:
    from remat.plan.planners import plan

    return plan(job.profile, strategy=strategy, budget=budget)


def _verify(job: _Job, plan: Any, *, repeats: int = 3) -> Any:
    """Baseline against planned step (`remat.verify`); ``repeats`` timed steps each."""
    from remat.verify import verify

    b = job.built
    return verify(b.model, b.batch, plan, loss_fn=b.loss_fn, optimizer=b.optimizer, repeats=repeats)


GPT_SIZES: dict[str, Any] = {
    "num_layers": 4, "d_model": 128, "num_heads": 4, "seq_len": 64, "batch_size": 4,
    "vocab_size": 512, "dropout": 0.1, "attention": "explicit",
}
"""The built-in GPT as the demonstrations use it, pinned (the model's defaults may change)."""


def _gpt(**overrides: Any) -> dict[str, Any]:
    return {**GPT_SIZES, **overrides}


def _activation_bytes(job: _Job, peak_bytes: int) -> int:
    """The part of a measured step peak above model state (parameters, grads, optimizer state)."""
    return peak_bytes - job.profile.model_state_bytes


def _step_flops(job: _Job) -> int:
    """FLOPs of one forward + backward as it runs now (recomputation included), counted by dispatch."""
    b = job.built
    with FlopCounterMode(display=False) as counter:
        forward_backward(b.model, b.batch, b.loss_fn)
    b.model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _flops_with(job: _Job, plan: Any) -> int:
    with _applied(job.model, plan):
        return _step_flops(job)


@contextlib.contextmanager
def _applied(model: nn.Module, plan: Any, **options: Any) -> Iterator[nn.Module]:
    from remat.apply.api import apply_, remove_

    apply_(model, plan, **options)
    try:
        yield model
    finally:
        remove_(model)


def _kib(num_bytes: float) -> float:
    return num_bytes / KIB


def _fmt_kib(num_bytes: float) -> str:
    return f"{_kib(num_bytes):,.1f} KiB"


# ---------------------------------------------------------------- Q1: recomputation costs FLOPs


@demonstration("tradeoff")
def extra_flops_of_full_recomputation() -> Demonstration:
    """Full recomputation on the built-in GPT: FLOPs and time it adds, gradients it leaves alone."""
    job = _job("gpt", **_gpt())
    full = _plan(job, "full")
    base_flops = _step_flops(job)
    extra_flops = _flops_with(job, full) - base_flops
    check = _verify(job, full)
    values = {
        "extra_gflops": extra_flops / 1e9,
        "extra_flops_pct": 100.0 * extra_flops / base_flops,
        "predicted_extra_gflops": full.prediction.extra_flops / 1e9,
        "overhead_pct": check.overhead_pct,
        "grads_identical": check.grads_identical,
    }
    rows = (
        _row("model", f"gpt, {job.profile.num_blocks}"),
        _row("step_flops_none", f"{base_flops / 1e9:.3f} GFLOP"),
        _row("extra_flops_counted", f"{extra_flops / 1e9:.3f} GFLOP"),
        _row("extra_flops_predicted", f"{full.prediction.extra_flops / 1e9:.3f} GFLOP"),
        _row("step_ms_none", f"{check.baseline_step_ms:.1f} ms"),
        _row("step_ms_full", f"{check.measured_step_ms:.1f} ms"),
        _row("grads_identical", str(check.grads_identical)),
    )
    return Demonstration(question_id="tradeoff", values=values, holds=extra_flops > 0 and check.grads_identical, rows=rows)


# ---------------------------------------------------------------- Q2: what autograd saves


def _op_base(name: str) -> str:
    """``"aten.addmm.default"`` -> ``"addmm"``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else name


def _saving_op_name(ops: Sequence[Any], i: int) -> str:
    """A reader's name for op ``i``: a buffer that a random op fills next is a dropout mask."""
    if i + 1 < len(ops) and ops[i + 1].is_random and ops[i + 1].output_bytes == 0:
        return "dropout mask"
    return _op_base(ops[i].name)


def _saved_by_op(block: Any) -> list[tuple[str, int, int]]:
    """(op, calls that saved, saved bytes) of one profiled block, largest first."""
    totals: dict[str, list[int]] = {}
    for i, op in enumerate(block.ops):
        if op.saved_bytes > 0:
            entry = totals.setdefault(_saving_op_name(block.ops, i), [0, 0])
            entry[0] += 1
            entry[1] += op.saved_bytes
    return sorted(((name, n, b) for name, (n, b) in totals.items()), key=lambda t: -t[2])


@demonstration("why-saved")
def what_autograd_saves() -> Demonstration:
    """The bytes autograd keeps per block of the built-in GPT for backward, and which ops keep them."""
    job = _job("gpt", repeats=1, **_gpt())
    block = job.profile.blocks[0]
    params = sum(p.numel() * p.element_size() for p in job.model.get_submodule(block.name).parameters())
    by_op = _saved_by_op(block)
    top = ", ".join(f"{name} {_kib(b):.0f} KiB" for name, _, b in by_op[:4])
    values = {
        "saved_kib_per_block": _kib(block.saved_bytes),
        "params_kib_per_block": _kib(params),
        "top_ops": top,
        "num_blocks": job.profile.num_blocks,
        "saved_kib_all_blocks": _kib(sum(b.saved_bytes for b in job.profile.blocks)),
    }
    rows = (_row("block_saved", _fmt_kib(block.saved_bytes), block=block.name),
            _row("block_weights", _fmt_kib(params), block=block.name))
    rows += tuple(_row("saving_op", _fmt_kib(b), op=name, calls=n) for name, n, b in by_op)
    return Demonstration(question_id="why-saved", values=values, holds=block.saved_bytes > 0 and bool(by_op), rows=rows)


# ---------------------------------------------------------------- Q3: the overhead depends on the model

_Q3_MODELS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("gpt (vocab 4096)", "gpt", _gpt(vocab_size=4096)),
    ("mlp (8 blocks)", "mlp", {"depth": 8, "width": 256, "batch_size": 64}),
)


def _full_overhead(name: str, sizes: dict[str, Any]) -> tuple[float, float]:
    """(measured step-time overhead %, counted extra FLOPs %) of full recomputation on one model."""
    job = _job(name, **sizes)
    full = _plan(job, "full")
    base = _step_flops(job)
    extra_pct = 100.0 * (_flops_with(job, full) - base) / base
    return _verify(job, full).overhead_pct, extra_pct


@demonstration("measure-overhead")
def same_strategy_two_models() -> Demonstration:
    """Full recomputation on two built-in models: the same strategy, different overheads."""
    (label_a, name_a, sizes_a), (label_b, name_b, sizes_b) = _Q3_MODELS
    time_a, flops_a = _full_overhead(name_a, sizes_a)
    time_b, flops_b = _full_overhead(name_b, sizes_b)
    values = {
        "name_a": label_a, "name_b": label_b,
        "overhead_a_pct": time_a, "overhead_b_pct": time_b,
        "extra_flops_a_pct": flops_a, "extra_flops_b_pct": flops_b,
    }
    rows = (
        _row("overhead_time", f"{time_a:+.1f} %", model=label_a),
        _row("overhead_flops", f"{flops_a:+.1f} %", model=label_a),
        _row("overhead_time", f"{time_b:+.1f} %", model=label_b),
        _row("overhead_flops", f"{flops_b:+.1f} %", model=label_b),
    )
    # FLOP counts are exact, times are not: the claim is judged on the counted replay work.
    return Demonstration(question_id="measure-overhead", values=values, holds=abs(flops_a - flops_b) >= 5.0, rows=rows)


# ---------------------------------------------------------------- Q4: sqrt(N) segments

SQRT_DEPTHS = (16, 64, 256)
"""Chain lengths of the sqrt(N) study (perfect squares: segments of exactly sqrt(N) blocks)."""


def fitted_exponent(sizes: Sequence[int], values: Sequence[float]) -> float:
    """The slope of log(values) against log(sizes): values grow as sizes**slope."""
    slope, _ = np.polyfit(np.log(np.asarray(sizes, dtype=float)), np.log(np.asarray(values, dtype=float)), 1)
    return float(slope)


def _chain_activation_bytes(depth: int) -> tuple[int, int]:
    """Measured bytes the blocks of a ``depth``-block chain hold at the step's peak: (none, sqrt).

    The measured peak less model state and less the fixed part's saved bytes (read-out and loss,
    which do not grow with the chain)."""
    # Narrow and tall, without an optimizer: activations dominate the step's memory.
    # Memory only: one timed step is enough.
    job = _job("mlp", depth=depth, width=16, batch_size=512, optimizer="none", repeats=1)
    outside = job.profile.model_state_bytes + job.profile.fixed_saved_bytes
    check = _verify(job, _plan(job, "sqrt"), repeats=1)
    return check.baseline_peak_bytes - outside, check.measured_peak_bytes - outside


@demonstration("sqrt-n")
def sqrt_segments_scaling() -> Demonstration:
    """Activation memory of 16, 64 and 256-block chains with sqrt(N) segments against none."""
    measured = [_chain_activation_bytes(depth) for depth in SQRT_DEPTHS]
    none_bytes, sqrt_bytes = [m[0] for m in measured], [m[1] for m in measured]
    exponent = fitted_exponent(SQRT_DEPTHS, sqrt_bytes)
    exponent_none = fitted_exponent(SQRT_DEPTHS, none_bytes)
    values = {"exponent": exponent, "exponent_none": exponent_none,
              "sqrt_kib": [_kib(b) for b in sqrt_bytes], "none_kib": [_kib(b) for b in none_bytes]}
    rows = tuple(
        _row("chain_bytes", f"{_fmt_kib(n)} / {_fmt_kib(s)}", depth=depth)
        for depth, n, s in zip(SQRT_DEPTHS, none_bytes, sqrt_bytes)
    ) + (_row("fitted_exponent", f"{exponent_none:.2f} / {exponent:.2f}"),)
    return Demonstration(question_id="sqrt-n", values=values, holds=0.4 <= exponent <= 0.6, rows=rows)


# ---------------------------------------------------------------- Q5: selective against full

SELECTIVE_POLICY = "selective:save-matmuls"


@demonstration("selective")
def selective_against_full() -> Demonstration:
    """Keep, selective (save the matmuls, replay the rest) and full recomputation on the built-in GPT."""
    job = _job("gpt", **_gpt(seq_len=128))
    plans = {"selective": _plan(job, SELECTIVE_POLICY), "full": _plan(job, "full")}
    checks = {name: _verify(job, plan) for name, plan in plans.items()}
    act = {name: _activation_bytes(job, c.measured_peak_bytes) for name, c in checks.items()}
    act["keep"] = _activation_bytes(job, checks["full"].baseline_peak_bytes)
    step_ms = {name: c.measured_step_ms for name, c in checks.items()}
    step_ms["keep"] = checks["full"].baseline_step_ms
    extra = {name: p.prediction.extra_flops for name, p in plans.items()} | {"keep": 0}
    values = {f"{name}_kib": _kib(b) for name, b in act.items()}
    values |= {f"{name}_ms": ms for name, ms in step_ms.items()}
    values |= {f"{name}_extra_gflops": flops / 1e9 for name, flops in extra.items()}
    rows = tuple(_row(f"strategy_{name}", f"{_fmt_kib(act[name])} / {step_ms[name]:.1f} ms / {extra[name] / 1e9:.3f} GFLOP")
                 for name in ("keep", "selective", "full"))
    holds = (act["full"] <= act["selective"] < act["keep"] and extra["selective"] < extra["full"]
             and all(c.grads_identical for c in checks.values()))
    return Demonstration(question_id="selective", values=values, holds=holds, rows=rows)


# ---------------------------------------------------------------- Q6: offload to disk


def _every_block(job: _Job, strategy: str) -> Any:
    """A plan with ``strategy`` on every block, predicted by `remat.predict`."""
    from remat.plan.planners import make_plan
    from remat.plan.types import Segment

    segments = tuple(Segment(start=i, stop=i + 1, strategy=strategy) for i in range(job.profile.num_blocks))
    return make_plan(job.profile, segments, strategy, None)


def _forward_end_bytes(timeline: Sequence[Any]) -> int:
    """Live bytes at the last forward point of a step's timeline (what the forward left resident)."""
    forward = [e.live_bytes for e in timeline if e.phase == "fwd"]
    if not forward:
        raise RuntimeError("the measured timeline has no forward points; cannot compare memory after the forward.")
    return forward[-1]


def _with_disk_rates(job: _Job, directory: str) -> _Job:
    """The job with its profile's disk bandwidths measured in ``directory`` (what offload:disk costs)."""
    from remat.measure.bandwidth import measure_bandwidths

    rates = measure_bandwidths(model_device(job.model), offload_dir=directory)
    return _Job(built=job.built, profile=dataclasses.replace(job.profile, bandwidths=rates))


@demonstration("offload")
def disk_offload_memory() -> Demonstration:
    """Disk offload of every GPT block's saved tensors: memory held after the forward, before and after."""
    with tempfile.TemporaryDirectory(prefix="remat-quiz-") as directory:
        job = _with_disk_rates(_job("gpt", **_gpt(seq_len=128)), directory)
    plan = _every_block(job, "offload:disk")
    check = _verify(job, plan)
    before = _forward_end_bytes(job.profile.timeline)
    after = _forward_end_bytes(check.timeline)
    moved = plan.prediction.offloaded_bytes
    values = {"before_kib": _kib(before), "after_kib": _kib(after),
              "offloaded_kib": _kib(moved), "grads_identical": check.grads_identical}
    rows = (_row("after_forward_none", _fmt_kib(before)),
            _row("after_forward_offload", _fmt_kib(after)),
            _row("written_to_disk", _fmt_kib(moved)),
            _row("peak_none_offload", f"{_fmt_kib(check.baseline_peak_bytes)} / {_fmt_kib(check.measured_peak_bytes)}"),
            _row("step_ms_none_offload", f"{check.baseline_step_ms:.1f} ms / {check.measured_step_ms:.1f} ms"),
            _row("grads_identical", str(check.grads_identical)))
    holds = after < before and moved > 0 and check.grads_identical
    return Demonstration(question_id="offload", values=values, holds=holds, rows=rows)


# ---------------------------------------------------------------- Q7: dropout and the RNG state

RNG_SEED = 1234


def _grads(job: _Job, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter gradient of one forward + backward drawn from ``seed``."""
    b = job.built
    b.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    forward_backward(b.model, b.batch, b.loss_fn)
    grads = {n: p.grad.detach().clone() for n, p in b.model.named_parameters() if p.grad is not None}
    b.model.zero_grad(set_to_none=True)
    return grads


def _max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@contextlib.contextmanager
def _checkpoint_without_rng(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """Checkpoint every block the way remat refuses to: the replay draws fresh random numbers."""
    for block in blocks:
        forward = block.forward
        block.forward = lambda *args, _f=forward, **kw: checkpoint(
            _f, *args, use_reentrant=False, preserve_rng_state=False, **kw
        )
    try:
        yield
    finally:
        for block in blocks:
            del block.forward  # the class's own forward again


@demonstration("rng")
def dropout_replay_rng() -> Demonstration:
    """GPT with dropout 0.1: gradients of full recomputation with and without the RNG state preserved."""
    job = _job("gpt", repeats=1, **_gpt())
    baseline = _grads(job, RNG_SEED)
    with _applied(job.model, _plan(job, "full")):
        preserved = _grads(job, RNG_SEED)
    with _checkpoint_without_rng([job.model.get_submodule(b.name) for b in job.profile.blocks]):
        not_preserved = _grads(job, RNG_SEED)
    identical = all(torch.equal(baseline[n], preserved[n]) for n in baseline)
    differ = any(not torch.equal(baseline[n], not_preserved[n]) for n in baseline)
    values = {"diff_preserved": _max_abs_diff(baseline, preserved),
              "diff_not_preserved": _max_abs_diff(baseline, not_preserved),
              "identical_preserved": identical, "differ_not_preserved": differ}
    rows = (_row("diff_preserved", f"{values['diff_preserved']:.3e}"),
            _row("diff_not_preserved", f"{values['diff_not_preserved']:.3e}"),
            _row("grads_identical", str(identical)))
    return Demonstration(question_id="rng", values=values, holds=identical and differ, rows=rows)


# ---------------------------------------------------------------- Q8: optimizer state is not activation memory


def _infeasible_reason(job: _Job, budget_bytes: int) -> str:
    """The planner's answer for ``budget_bytes``: its error message, or "" if it found a plan."""
    try:
        _plan(job, "optimal", budget=budget_bytes)
    except ValueError as err:
        return str(err)
    return ""


@demonstration("optimizer-state")
def optimizer_state_over_budget() -> Demonstration:
    """A wide MLP with AdamW whose optimizer state alone exceeds the budget: the planner refuses."""
    job = _job("mlp", depth=2, width=1024, batch_size=2, optimizer="adamw", repeats=1)
    prof = job.profile
    budget = prof.optimizer_state_bytes * 3 // 4
    reason = _infeasible_reason(job, budget)
    full = _plan(job, "full")
    values = {"optimizer_state_kib": _kib(prof.optimizer_state_bytes), "budget_kib": _kib(budget),
              "param_kib": _kib(prof.param_bytes),
              "reason": reason.splitlines()[0] if reason else "a plan was found"}
    rows = (_row("parameters", _fmt_kib(prof.param_bytes)), _row("gradients", _fmt_kib(prof.grad_bytes)),
            _row("optimizer_state", _fmt_kib(prof.optimizer_state_bytes), optimizer=prof.optimizer_name),
            _row("activations", _fmt_kib(prof.saved_bytes)),
            _row("peak_full", _fmt_kib(full.prediction.peak_bytes)),
            _row("budget", _fmt_kib(budget)),
            _row("planner_answer", reason or "-"))
    holds = bool(reason) and "optimizer state" in reason.lower() and full.prediction.peak_bytes > budget
    return Demonstration(question_id="optimizer-state", values=values, holds=holds, rows=rows)
