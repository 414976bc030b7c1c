"""A Plan: per block or segment its strategy, the prediction, the budget, the fingerprint.

Strategy strings (`Segment.strategy`):
- ``"keep"``: store what autograd saves;
- ``"recompute"``: store only the segment's input, replay its forward in backward
  (non-reentrant checkpoint); ``children`` say how the replay itself is checkpointed
  (nested segments inside ``[start, stop)``, in order and without overlap; blocks between
  them are kept during the replay);
- ``"selective:<policy>"`` (single-block segments): save the outputs of the op calls named in
  ``saved_ops`` (keys of `remat.measure.types.OpRecord`), recompute the rest of the block;
- ``"offload:cpu"`` / ``"offload:disk"``: move the segment's saved tensors off the device.

Besides the blocks, a plan names how the head (output projection and loss) runs: `Plan.head`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from remat._serialize import JsonDocument, Rules
from remat.head.names import check_head_name
from remat.measure.types import Fingerprint, block_names_hash

PLAN_FORMAT = "plan"
PLAN_VERSION = 1
PLAN_RULES = Rules(
    signed=frozenset({"extra_ms", "lower_bound_ms", "fault_saving_ms"}),
    floors=(("peak_block", -1), ("budget_bytes", 1), ("quantum_bytes", 1)),
)
"""Beyond the type hints: a plan's time differences may be negative (less fresh memory faulted
in than the baseline); ``peak_block`` is -1 outside blocks; a budget is positive."""

STRATEGY_KINDS = ("keep", "recompute", "selective", "offload")

_OP_KEY = re.compile(r"[^\s#]+#[0-9]+")
"""An op key: ``"<aten op name>#<occurrence>"`` (`remat.measure.types.OpRecord.key`)."""


@dataclass(kw_only=True, frozen=True)
class Segment:
    """A run of consecutive blocks ``[start, stop)`` with one strategy."""

    start: int
    """First block index."""
    stop: int
    """One past the last block index."""
    strategy: str
    """``keep``, ``recompute``, ``selective:<policy>``, ``offload:cpu`` or ``offload:disk``."""
    saved_ops: tuple[str, ...] = ()
    """Selective only: op keys (``"aten.mm.default#0"``) whose outputs are saved."""
    children: tuple[Segment, ...] = ()
    """Recompute only: nested segments that checkpoint the replay."""

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in STRATEGY_KINDS:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; allowed: keep, recompute, "
                "selective:<policy>, offload:cpu, offload:disk."
            )
        if not 0 <= self.start < self.stop:
            raise ValueError(f"segment [{self.start}, {self.stop}) is empty or negative.")
        if kind == "selective" and self.stop - self.start != 1:
            raise ValueError(
                f"selective segment [{self.start}, {self.stop}) spans several blocks; "
                "selective strategies apply to one block at a time."
            )
        if kind == "selective":
            self._check_selective()
        elif self.saved_ops:
            raise ValueError(f"segment [{self.start}, {self.stop}) is {self.strategy!r} but names saved_ops; "
                             "only selective segments save op outputs.")
        if kind == "offload" and self.strategy not in ("offload:cpu", "offload:disk"):
            raise ValueError(f"unknown offload target {self.strategy!r}; use offload:cpu or offload:disk.")
        if self.children and kind != "recompute":
            raise ValueError(f"only recompute segments may nest; got children under {self.strategy!r}.")
        pos = self.start
        for child in self.children:
            if not (self.start <= child.start and child.stop <= self.stop):
                raise ValueError(
                    f"child segment [{child.start}, {child.stop}) lies outside its parent "
                    f"[{self.start}, {self.stop})."
                )
            if child.start < pos:
                raise ValueError(
                    f"child segments of [{self.start}, {self.stop}) must be in order without overlap; "
                    f"[{child.start}, {child.stop}) starts before {pos}, where the child before it ends."
                )
            pos = child.stop

    def _check_selective(self) -> None:
        if not self.strategy.startswith("selective:") or len(self.strategy) == len("selective:"):
            raise ValueError(f"selective strategy {self.strategy!r} names no policy; write selective:<policy>.")
        bad = next((k for k in self.saved_ops if not _OP_KEY.fullmatch(k)), None)
        if bad is not None:
            raise ValueError(f"saved op key {bad!r} of segment [{self.start}, {self.stop}) is not an op key "
                             "like 'aten.mm.default#0' (the op's name, '#', its occurrence in the block).")

    @property
    def kind(self) -> str:
        """``keep``, ``recompute``, ``selective`` or ``offload``."""
        return self.strategy.split(":", 1)[0]

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start

    @property
    def stops_early(self) -> bool:
        """A recompute segment whose replay ends with a kept block (no child covers its last
        block, or a ``keep`` one does), or a selective block: it runs with torch's
        ``early_stop=True``, so the replay of its last block stops at that block's last saved
        tensor (`remat.measure.types.BlockProfile.replay_stop_calls`; a selective block's cached
        calls past it are never fetched, so plans name none: `remat.plan.costs.cached_ops`). A
        recompute segment whose replay ends in a nested checkpoint or a selective block runs
        that replay whole."""
        if self.kind == "selective":
            return True
        if self.kind != "recompute":
            return False
        last = self.stop - 1
        return all(c.kind == "keep" for c in self.children if c.start <= last < c.stop)


@dataclass(kw_only=True, frozen=True)
class Prediction:
    """What the memory and time model predicts for one plan on one profile."""

    peak_bytes: int
    """Predicted peak live bytes of the whole training step."""
    step_ms: float
    """Predicted step time."""
    extra_flops: int
    """FLOPs of recomputation (replayed forwards) per step."""
    extra_ms: float
    """Time of recomputation and exposed offload transfers per step."""
    model_state_bytes: int
    """Parameters + gradients + optimizer state + buffers."""
    fixed_bytes: int
    """Saved bytes of the fixed part counted at the peak."""
    retained_bytes: tuple[int, ...]
    """Per block: bytes it holds while backward runs the blocks after it."""
    peak_block: int
    """Index of the block whose backward (or replay) sets the peak; -1 when the peak is outside
    blocks (head backward, optimizer step)."""
    peak_phase: str
    """Where the peak falls: ``"block"``, ``"post"``, ``"optimizer"`` or ``"forward"``."""
    working_bytes: int
    """Working set of the peak block (its saved bytes rematerialized + backward temporaries)."""
    offloaded_bytes: int = 0
    """Bytes moved off the device per step."""
    fault_bytes: int = 0
    """Host memory the step faults in fresh (`remat.plan.predict.fresh_memory`)."""
    fault_saving_ms: float = 0.0
    """Time the step saves against the baseline by faulting in less fresh memory (in ``step_ms``)."""


@dataclass(kw_only=True, frozen=True)
class Optimality:
    """How close an optimal plan is to the fastest plan that fits its budget, under the byte and
    time model of `remat.plan.predict` (`remat.plan.search.OptimalSearch.choose`)."""

    extra_ms: float
    """The plan's predicted step time less the baseline step's (`remat.plan.predict.baseline_step_ms`):
    recomputation and exposed transfers, less the fresh-memory saving."""
    lower_bound_ms: float
    """No plan whose predicted peak fits the budget has a smaller ``extra_ms``."""
    quantum_bytes: int
    """The search's memory unit: 1 when it counted bytes exactly; a larger slot on long chains."""

    @property
    def exact(self) -> bool:
        """The plan is optimal: its extra time equals the lower bound."""
        return self.extra_ms <= self.lower_bound_ms + 1e-9 * max(1.0, abs(self.lower_bound_ms))

    @property
    def gap_ms(self) -> float:
        """At most this much slower than the fastest plan that fits."""
        return max(0.0, self.extra_ms - self.lower_bound_ms)


def _check_block_names(names: tuple[str, ...]) -> None:
    """Block names are module paths: non-empty (``""`` is the model itself), unique."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(
                f"block_names[{i}] is {name!r}; a block name is the qualified name of a submodule "
                "(\"layers.0\"), never empty (the model itself) nor padded with spaces."
            )
        if name in seen:
            raise ValueError(f"block_names[{i}] {name!r} appears twice; each block is named once.")
        seen.add(name)


@dataclass(kw_only=True, frozen=True)
class TunedCandidate:
    """One layout measured tuning timed (`remat.plan.tune`): predicted against measured."""

    name: str
    """Where it came from: ``optimal``, ``optimal #2``, a recipe (``full``, ``sqrt``,
    ``checkpoint_sequential``, ``selective:<policy>``...); ``a = b`` when two gave the same layout."""
    segments: tuple[Segment, ...]
    """Its layout."""
    head: str = "keep"
    """How it runs the head."""
    predicted_step_ms: float
    predicted_peak_bytes: int
    measured_step_ms: float | None = None
    """Median of its timed steps (None: never timed)."""
    measured_peak_bytes: int | None = None
    """Peak of one step under the live-storage tracker (None: not measured)."""
    device_peak_bytes: int | None = None
    """CUDA: ``torch.cuda.max_memory_allocated`` over that step (the allocator's view, batch and
    cached blocks included; shown, not checked against the budget); None elsewhere."""
    rounds: int = 0
    """Timed steps it ran (one per round; the warm-up and the tracked step are not counted)."""
    dropped: str = ""
    """Why it could not win (its measured peak over the budget, an error), or empty."""


@dataclass(kw_only=True, frozen=True)
class Tuning:
    """What measured tuning timed and which candidate won (`remat.plan.tune`)."""

    candidates: tuple[TunedCandidate, ...]
    """Every candidate, in the order they were made (the cost model's plans first)."""
    winner: str
    """Name of the candidate with the least measured median among those not dropped."""
    max_steps: int
    """The bound on timed steps per candidate."""
    max_seconds: float
    """The bound on the timing rounds' wall-clock time (checked after each round)."""
    rounds: int
    """Rounds run: each timed every candidate still in once, in an order rotated every round."""
    seconds: float
    """Wall-clock time the timing rounds took."""

    def __post_init__(self) -> None:
        names = [c.name for c in self.candidates]
        if self.winner not in names:
            raise ValueError(f"tuning winner {self.winner!r} is not one of the candidates {names}.")


@dataclass(kw_only=True, frozen=True)
class Plan(JsonDocument):
    """A plan to apply with `remat.apply_`; round-trips through versioned JSON."""

    DOCUMENT = (PLAN_FORMAT, PLAN_VERSION, PLAN_RULES)

    segments: tuple[Segment, ...]
    """Top-level segments covering blocks 0..N-1 in order, without gaps."""
    block_names: tuple[str, ...]
    """Qualified names of the blocks, in order."""
    strategy_name: str
    """The planner that made it: ``none``, ``full``, ``every:K``, ``sqrt``, ``selective:<p>``, ``optimal``."""
    budget_bytes: int | None
    """The byte budget it was planned for (None: no budget)."""
    prediction: Prediction
    """The model's prediction for this plan on the profile it came from."""
    fingerprint: Fingerprint
    """The profile's fingerprint: apply_ refuses a model that does not match."""
    head: str = "keep"
    """How the output projection and the loss run (`remat.head.strategies`): ``keep`` (as the
    model runs them), ``recompute`` or ``chunked:<tokens>``; under the last two the model's
    output carries no logits in training. Plans without it (older files) keep the head."""
    optimality: Optimality | None = None
    """Strategy ``optimal`` under a budget: how far the plan may be from the fastest that fits."""
    grad_accumulation: bool = False
    """Planned for a micro-batch under gradient accumulation (its profile's
    `remat.measure.types.Profile.grad_accumulation`): `remat.verify` measures such a step."""
    tuning: Tuning | None = None
    """Measured tuning (`remat.plan.tune`): every candidate timed, predicted against measured, and
    the winner (this plan's layout). Plans without it (not tuned, older files) have None."""
    compiled_backend: str = ""
    """The ``torch.compile`` backend its profile was taken with (`remat.measure.types.Profile.compiled_backend`):
    the plan is for the model compiled so, its prediction the compiled step's; "" for eager."""

    def __post_init__(self) -> None:
        self.check(segments=False)

    def check(self, *, segments: bool = True) -> None:
        """Raise ValueError unless the plan's invariants hold (construction checks them; `apply_`
        checks again, for an object changed by force). ``segments``: re-check every segment too."""
        if segments:
            stack = list(self.segments)
            while stack:
                seg = stack.pop()
                seg.__post_init__()
                stack.extend(seg.children)
        check_head_name(self.head)
        _check_block_names(self.block_names)
        self._check_fingerprinted_names()
        pos = 0
        for seg in self.segments:
            if seg.start != pos:
                raise ValueError(
                    f"plan segments must cover blocks 0..{len(self.block_names) - 1} in order; "
                    f"segment [{seg.start}, {seg.stop}) starts at {seg.start}, expected {pos}."
                )
            pos = seg.stop
        if pos != len(self.block_names):
            raise ValueError(
                f"plan segments cover {pos} blocks but the plan names {len(self.block_names)}."
            )

    def _check_fingerprinted_names(self) -> None:
        recorded = self.fingerprint.block_names_hash
        if recorded and recorded != block_names_hash(self.block_names):
            raise ValueError(
                f"the plan's block_names {list(self.block_names)} are not the blocks it was profiled and "
                f"planned with (fingerprint block_names_hash {recorded!r}); plan again from the profile "
                "(remat.plan) instead of editing block names."
            )


    def block_strategies(self) -> tuple[str, ...]:
        """Top-level strategy of each block, in order."""
        out: list[str] = []
        for seg in self.segments:
            out.extend([seg.strategy] * seg.num_blocks)
        return tuple(out)
