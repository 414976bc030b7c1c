"""Planners: turn a Profile (and a byte budget) into a Plan.

Strategies (``strategy=``): ``none``, ``full`` (every block recomputed), ``every:K`` (segments
of K blocks), ``sqrt`` (Chen et al. 2016: segments of about sqrt(N) blocks), ``selective:<p>``
(policy p on every block; each fixed planner gives a block that cannot run its strategy the
nearest it can, `remat.plan.available`), and ``optimal``: the least predicted step time whose
predicted peak fits the budget, over keep / recompute / selective / offload per block plus
nested recompute segments (`remat.plan.search`). On chains of up to 48 blocks the search counts
bytes exactly and the plan is the optimum of the model at every budget from the least feasible
peak up; longer chains count memory in slots, and the plan carries the bound (`Plan.optimality`;
BENCHMARKS.md, "Planning speed").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol

from remat.measure.types import Profile
from remat.plan.available import check_available, fall_back, warn_fallen_back
from remat.plan.budget import float_bytes, format_bytes, parse_budget
from remat.plan.costs import reached_saved_ops
from remat.plan.head import check_head, head_choices, priced_profile
from remat.plan.infeasible import check_state_fits, infeasible_error
from remat.plan.joins import chain_runs, joins
from remat.plan.offload_cost import offload_strategies
from remat.plan.predict import baseline_step_ms, check_profile, extra_ms, predict
from remat.plan.policies import policy
from remat.plan.search import Choice, OptimalSearch, plan_floor
from remat.plan.types import Optimality, Plan, Prediction, Segment

__all__ = ["plan", "pareto", "PlanTuner", "STRATEGIES", "make_plan", "min_peak_plan", "optimal_search"]

FixedPlanner = Callable[[Profile, str, int | None], tuple[Segment, ...]]
STRATEGIES: dict[str, FixedPlanner] = {}
"""Planners keyed by the strategy name before ``:`` (``every:4`` -> ``every``)."""


def _strategy(name: str) -> Callable[[FixedPlanner], FixedPlanner]:
    def wrap(fn: FixedPlanner) -> FixedPlanner:
        STRATEGIES[name] = fn
        return fn

    return wrap


class PlanTuner(Protocol):
    """What ``plan(..., tune=...)`` takes: something that holds the model and a batch and times
    candidate plans through the real runtime (`remat.Tuner`, `remat.apply.tune`)."""

    def tuned_plan(self, profile: Profile, budget: int, head: str | None) -> Plan: ...


def plan(profile: Profile, budget: int | float | str | None = None, strategy: str = "optimal", head: str | None = None,
         *, tune: PlanTuner | None = None) -> Plan:
    """A plan for ``profile`` under ``budget``: bytes, or text for `parse_budget` (``"6GiB"``,
    ``"40%"`` of the profile's measured peak, or of the predicted no-recomputation peak).

    ``head``: how the output projection and loss run (`remat.plan.head`): ``keep``, ``recompute``
    or ``chunked:<tokens>`` (a measured chunk size); None: the optimal planner searches every
    head strategy the profile measured (one more choice around the blocks' search), the other
    planners keep the head.

    ``tune``: a `remat.Tuner` (the model, a batch, loss and optimizer, and the time bound): the
    cost model's best few plans and every recipe that fits are timed side by side on the model
    and the fastest measured whose measured peak fits wins (`remat.plan.tune`; the plan's
    ``tuning`` records what was timed). Needs strategy ``optimal`` and a budget."""
    check_profile(profile, "plan")
    if isinstance(budget, str):
        budget = parse_budget(budget, _baseline_peak(profile))
    if isinstance(budget, float):
        budget = float_bytes(budget)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise TypeError(f"budget must be a positive int of bytes, text like '6GiB' or None, got {budget!r}.")
    if profile.num_blocks == 0:
        raise ValueError("the profile has no blocks, so there is nothing to plan; profile with blocks named.")
    kind = strategy.split(":", 1)[0]
    if kind not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {strategy!r}; allowed: none, full, every:K, sqrt, selective:<policy>, optimal."
        )
    if kind == "optimal":
        _no_argument(strategy)
    if head is not None:
        check_head(profile, head)
    tune = None if tune is False else tune
    _check_tune(tune, strategy, budget)
    heads = (head,) if head is not None else head_choices(profile) if kind == "optimal" else ("keep",)
    if budget is not None:
        floor_bytes, floor_name = min(plan_floor(priced_profile(profile, h)) for h in heads)
        check_state_fits(profile, budget, floor_bytes, floor_name)
    if tune is not None:
        return tune.tuned_plan(profile, budget, head)
    if kind == "optimal":
        result = _optimal_plan(profile, heads, budget)
    else:
        asked = STRATEGIES[kind](priced_profile(profile, heads[0]), strategy, budget)
        segments = fall_back(profile, asked)
        if segments != tuple(asked):
            warn_fallen_back(profile, asked)
        result = make_plan(profile, segments, strategy, budget, head=heads[0])
    if budget is not None and result.prediction.peak_bytes > budget:
        best = min_peak_plan(profile).prediction
        if best.peak_bytes > budget:
            raise infeasible_error(budget, best, "any plan")
        raise ValueError(
            f"strategy {strategy!r} predicts a peak of {format_bytes(result.prediction.peak_bytes)} "
            f"({result.prediction.peak_bytes} bytes), over the budget of {format_bytes(budget)} "
            f"({budget} bytes); strategy 'optimal' fits it (down to {best.peak_bytes} bytes)."
        )
    return result


def _check_tune(tune: object, strategy: str, budget: int | None) -> None:
    if tune is None:
        return
    if tune is True or not hasattr(tune, "tuned_plan"):
        raise TypeError(
            f"tune={tune!r}: tuning runs the model, so it needs the model and a batch: pass "
            "tune=remat.Tuner(model, batch, loss_fn, optimizer), or call remat.tune(model, batch, profile, budget)."
        )
    if strategy != "optimal":
        raise ValueError(f"tune= times the optimal planner's plans against the recipes; strategy {strategy!r} "
                         "is one plan already: leave strategy as 'optimal' to tune.")
    if budget is None:
        raise ValueError("tune= picks the fastest measured plan under a budget; give budget= (e.g. '40%').")


def _baseline_peak(profile: Profile) -> int:
    if profile.peak_bytes > 0:
        return profile.peak_bytes
    keep = tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(profile.num_blocks))
    return predict(profile, keep).peak_bytes


def make_plan(profile: Profile, segments: tuple[Segment, ...], strategy: str, budget: int | None,
              head: str = "keep", optimality: Optimality | None = None) -> Plan:
    """A Plan of ``segments`` and ``head`` with its prediction and the profile's fingerprint;
    ValueError when a segment's strategy cannot run on one of its blocks (`remat.plan.available`)."""
    check_available(profile, segments)
    segments = tuple(_reached(profile, seg) for seg in segments)
    return Plan(
        segments=segments,
        block_names=tuple(b.name for b in profile.blocks),
        strategy_name=strategy,
        budget_bytes=budget,
        prediction=predict(profile, segments, head),
        fingerprint=profile.fingerprint,
        head=head,
        optimality=optimality,
        grad_accumulation=profile.grad_accumulation,
        compiled_backend=profile.compiled_backend,
    )


def _reached(profile: Profile, seg: Segment) -> Segment:
    """``seg`` with every selective block's ``saved_ops`` cut to the calls its early-stopping
    replay reaches (`remat.plan.costs.reached_saved_ops`): a call past the last saved tensor
    would be cached in the forward and never fetched."""
    children = tuple(_reached(profile, c) for c in seg.children)
    saved = seg.saved_ops
    if seg.kind == "selective" and saved:
        saved = reached_saved_ops(profile.blocks[seg.start], saved)
    if children == seg.children and saved == seg.saved_ops:
        return seg
    return dataclasses.replace(seg, children=children, saved_ops=saved)


def optimal_search(profile: Profile, priced_like: OptimalSearch | None = None) -> OptimalSearch:
    """The optimal search over the plans the model can run: multi-block segments only where
    neighbouring blocks join (`remat.plan.joins`); ``priced_like``: `OptimalSearch`'s."""
    return OptimalSearch(profile, joins=joins(profile), priced_like=priced_like)


def head_searches(profile: Profile, heads: tuple[str, ...]) -> dict[str, OptimalSearch]:
    """The optimal search of ``profile`` priced with each head strategy: the blocks' options
    priced once for all of them (the head changes only the post part)."""
    searches: dict[str, OptimalSearch] = {}
    for head in heads:
        searches[head] = optimal_search(priced_profile(profile, head), next(iter(searches.values()), None))
    return searches


def _optimal_plan(profile: Profile, heads: tuple[str, ...], budget: int | None) -> Plan:
    """The fastest plan under ``budget`` over ``heads``: the blocks' optimal search on the
    profile priced with each head strategy (`remat.plan.head.priced_profile`), and no
    recomputation where it fits (counting memory in slots, the search prices a few dataflow terms
    above what `predict` prices for a whole plan: a mask no block saves counts from its first taker
    in every plan, though it is live only while a checkpoint holds it; `remat.plan.variants`),
    then the least predicted step time (of equal times, the lower peak)."""
    keep = _none(profile, "none", None)
    if budget is None:
        return make_plan(profile, keep, "optimal", None, head=heads[0])
    plans = []
    searches = head_searches(profile, heads)
    for head in heads:
        choice = searches[head].choose(budget)
        if choice is not None:
            plans.append(make_plan(profile, choice.segments, "optimal", budget, head=head, optimality=choice.optimality))
        for segments in (keep, *_recipes(profile, head)):  # what the search's bounds may price over
            if segments is not keep and not _may_be_faster(profile, segments, head, plans):
                continue
            predicted = predict(profile, segments, head)
            if predicted.peak_bytes <= budget:
                plans.append(make_plan(profile, segments, "optimal", budget, head=head,
                                       optimality=_candidate_optimality(profile, predicted, choice)))
    if not plans:
        space = "keep, recompute, nested segments and selective policies"
        offload = offload_strategies(profile)
        if offload:
            space += f", {' and '.join(offload)}"
        if heads != ("keep",):
            space += f", the head as {' or '.join(heads)}"
        raise infeasible_error(budget, min_peak_plan(profile, heads, searches).prediction, space)
    return min(plans, key=lambda p: (p.prediction.step_ms, p.prediction.peak_bytes))


def _may_be_faster(profile: Profile, segments: tuple[Segment, ...], head: str, plans: list[Plan]) -> bool:
    """Whether ``segments`` may be predicted faster than every plan found: its extra time less
    the most fresh memory any peak saves is below theirs (its peak, what costs most to price,
    is priced only then: 1000 blocks planned in 1.6 s instead of 1.15 s when both recipes were)."""
    if not plans:
        return True
    most_saved = profile.step_fault_bytes * profile.first_touch_ms_per_byte
    fastest = min(plan.prediction.step_ms for plan in plans)
    return baseline_step_ms(profile) + extra_ms(profile, segments, head) - most_saved < fastest


def _recipes(profile: Profile, head: str) -> list[tuple[Segment, ...]]:
    """The recipes' layouts (full recomputation, sqrt(N) segments), each block that cannot run
    its strategy on the nearest it can: candidates beside the search's, whose tables bound what
    the code holds beside checkpoints from above (`remat.plan.search.OptimalSearch.held_slack`)
    and may price such a layout over a budget it meets. Full recomputation of a residual-attention
    chain was the least predicted peak of `pareto` and refused at that budget, 3,128 bytes under
    the search's least."""
    return [fall_back(profile, STRATEGIES[name](priced_profile(profile, head), name, None)) for name in ("full", "sqrt")]


def _candidate_optimality(profile: Profile, predicted: Prediction, choice: Choice | None) -> Optimality:
    """A candidate's optimality beside the search's (no recomputation, a recipe's layout):
    nothing is faster than the search's bound (or, without a choice, than keeping everything
    less the most fresh memory a lower peak could save)."""
    extra = predicted.step_ms - baseline_step_ms(profile)
    if choice is not None:
        bound, quantum = choice.optimality.lower_bound_ms, choice.optimality.quantum_bytes
    else:
        bound, quantum = -profile.step_fault_bytes * profile.first_touch_ms_per_byte, 1
    return Optimality(extra_ms=extra, lower_bound_ms=min(extra, bound), quantum_bytes=quantum)


def min_peak_plan(profile: Profile, heads: tuple[str, ...] | None = None,
                  searches: dict[str, OptimalSearch] | None = None) -> Plan:
    """The plan with the least predicted peak over the whole plan space (every head strategy
    measured, or ``heads``; ``searches``: the optimal search of the profile priced with each, made
    here where not given)."""
    heads = heads or head_choices(profile)
    searches = searches or head_searches(profile, heads)
    plans = [make_plan(profile, searches[h].min_peak_segments(), "optimal", None, head=h) for h in heads]
    plans += [make_plan(profile, segments, "optimal", None, head=h) for h in heads for segments in _recipes(profile, h)]
    return min(plans, key=lambda p: (p.prediction.peak_bytes, p.prediction.step_ms))


def pareto(profile: Profile) -> list[Plan]:
    """Optimal plans from no recomputation down to the minimum feasible peak, by falling peak;
    each is faster than every plan with a lower predicted peak (over every head strategy).

    Past the byte-exact search's reach the frontier comes from the slot-counted one, whose
    rounding may leave out the least-peak plan and price some layouts above a recipe's: the
    least-peak plan (`min_peak_plan`) and the recipes' layouts (full recomputation, sqrt) join
    the candidates, so the last plan is the least peak and no plan is slower than one with a
    lower peak (a 256-layer Llama's frontier ended above ``full``'s peak, 20 of its plans slower)."""
    check_profile(profile, "pareto")
    heads = head_choices(profile)
    searches = head_searches(profile, heads)  # their tables made once
    plans = [make_plan(profile, segs, "optimal", None, head=head) for head in heads
             for segs in searches[head].frontier_segments()]
    plans.append(min_peak_plan(profile, heads, searches))
    plans += [make_plan(profile, segments, "optimal", None, head=head) for head in heads for segments in _recipes(profile, head)]
    plans.sort(key=lambda p: (p.prediction.peak_bytes, p.prediction.step_ms))
    frontier: list[Plan] = []
    for candidate in plans:
        if not frontier or candidate.prediction.step_ms < frontier[-1].prediction.step_ms:
            frontier.append(candidate)
    return frontier[::-1]


@_strategy("none")
def _none(profile: Profile, strategy: str, budget: int | None) -> tuple[Segment, ...]:
    _no_argument(strategy)
    return tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(profile.num_blocks))


@_strategy("full")
def _full(profile: Profile, strategy: str, budget: int | None) -> tuple[Segment, ...]:
    _no_argument(strategy)
    return _recompute_runs(profile, lambda run_blocks: 1)


@_strategy("every")
def _every(profile: Profile, strategy: str, budget: int | None) -> tuple[Segment, ...]:
    """Segments of K blocks, each run of joined blocks (`remat.plan.joins`) cut on its own."""
    text = strategy.partition(":")[2]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"strategy {strategy!r} needs a positive segment length, e.g. every:2.")
    return _recompute_runs(profile, lambda run_blocks: int(text))


@_strategy("sqrt")
def _sqrt(profile: Profile, strategy: str, budget: int | None) -> tuple[Segment, ...]:
    """Segments of ceil(sqrt(L)) blocks in each run of L joined blocks (Chen et al. 2016,
    "Training deep nets with sublinear memory cost", section 4.1: about sqrt(L) held inputs plus
    one replayed segment per chain; a segment never crosses a break, `remat.plan.joins`)."""
    _no_argument(strategy)
    return _recompute_runs(profile, lambda run_blocks: math.ceil(math.sqrt(run_blocks)))


@_strategy("selective")
def _selective(profile: Profile, strategy: str, budget: int | None) -> tuple[Segment, ...]:
    name = strategy.partition(":")[2]
    policy(name)
    if name == "knapsack":
        return optimal_search(profile).uniform_knapsack_segments(budget)
    return tuple(
        Segment(start=b.index, stop=b.index + 1, strategy=strategy, saved_ops=policy(name)(b)) for b in profile.blocks
    )


@_strategy("optimal")
def _optimal(profile: Profile, strategy: str, budget: int | None) -> tuple[Segment, ...]:
    """The blocks of the optimal plan with the head kept (`plan` searches the head too)."""
    _no_argument(strategy)
    return _optimal_plan(profile, ("keep",), budget).segments


def _recompute_runs(profile: Profile, length_of: Callable[[int], int]) -> tuple[Segment, ...]:
    """Recompute segments of ``length_of(L)`` blocks cut from each run of L joined blocks."""
    out: list[Segment] = []
    for start, stop in chain_runs(profile):
        length = length_of(stop - start)
        out += [Segment(start=a, stop=min(a + length, stop), strategy="recompute") for a in range(start, stop, length)]
    return tuple(out)


def _no_argument(strategy: str) -> None:
    if ":" in strategy:
        raise ValueError(f"strategy {strategy!r} takes no argument; write it without ':'.")
