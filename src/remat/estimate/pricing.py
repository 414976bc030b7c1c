"""Price each strategy on each device: the rank's model state, the planner's peak, the step time.

The per-device profile is the traced profile with the rank's model state filled in
(`remat.memory.model_state`: ZeRO sharding, the all-gathered ZeRO-3 unit counted as
parameters) and every time derived from FLOPs (`remat.estimate.scale.timed_for_device`).

Largest micro-batch: bytes grow with the micro-batch, so a doubling then bisection search
finds it with about 2 log2(b) predictions for ``none``, ``full`` and ``selective``. For
``optimal`` it is a lower bound: the best of those three and of the optimal search's
minimum-peak layout (one exact search at micro-batch 2, then priced at every micro-batch),
because running the exact search at every candidate would take too long for 80 layers.
When model state alone exceeds the device, no layout can fit, so ``optimal`` is not searched
and shows the full-recomputation layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

from remat.estimate.devices import DeviceSpec
from remat.estimate.explain import explain_activation_overflow, explain_state_overflow
from remat.estimate.results import DeviceEstimate, StrategyEstimate
from remat.estimate.scale import at_micro_batch, check_alike, replicate_blocks, timed_for_device
from remat.estimate.strategies import conservative, price
from remat.estimate.trace import Traced
from remat.measure.types import Bandwidths, Profile
from remat.memory.allowance import Allowance
from remat.memory.model_state import ModelState, model_state, shard_model_state
from remat.memory.optimizer_state import optimizer_layout
from remat.plan.predict import grad_bytes_live, predict
from remat.plan.search import OptimalSearch
from remat.plan.types import Prediction, Segment

MAX_MICRO_BATCH = 1 << 16


@dataclass(kw_only=True, frozen=True)
class Pricing:
    """Everything fixed across devices; builds the per-device profiles and prices strategies."""

    traced: Traced
    micro_batch: int
    optimizer: str
    precision: str
    world_size: int
    zero_stage: int
    accumulation: int
    mfu: float
    allowance: Allowance
    strategies: tuple[str, ...]
    foreach_optimizer: bool = False

    @cached_property
    def unsharded_state(self) -> ModelState:
        t = self.traced
        buffers = t.fixed_buffer_bytes + t.num_layers * t.block_buffer_bytes
        return model_state(t.param_shapes(), optimizer=self.optimizer, precision_name=self.precision, buffer_bytes=buffers)

    @cached_property
    def rank_state(self) -> ModelState:
        unit = model_state(self.traced.unit_shapes, optimizer=self.optimizer, precision_name=self.precision)
        return shard_model_state(self.unsharded_state, world_size=self.world_size, zero_stage=self.zero_stage,
                                 largest_unit=unit)

    def profile_at(self, micro_batch: int) -> Profile:
        """The whole model's profile at ``micro_batch`` (model state not yet filled in)."""
        t = self.traced
        return self._traced_at(micro_batch) if t.whole else replicate_blocks(
            self._traced_at(micro_batch), t.num_layers, name_format=t.block_name_format)

    def _traced_at(self, micro_batch: int) -> Profile:
        """The traced (few-layer) profile at ``micro_batch``."""
        t = self.traced
        if t.whole:
            return t.profile(1)
        if micro_batch == 1:
            check_alike(t.profile(1))
            return t.profile(1)
        check_alike(t.profile(2))
        return at_micro_batch(t.profile(2), t.profile(3), micro_batch)

    def device_profile(self, micro_batch: int, spec: DeviceSpec) -> Profile:
        """The profile at ``micro_batch`` with this rank's model state and FLOP-derived times
        (scaled and timed on the few traced layers, then copied: cheap for 80 layers)."""
        key = (micro_batch, spec.name)
        if key not in self._cache:
            self._cache[key] = self._device_profile(micro_batch, spec)
        return self._cache[key]

    @cached_property
    def _cache(self) -> dict[tuple[int, str], Profile]:
        return {}

    def _device_profile(self, micro_batch: int, spec: DeviceSpec) -> Profile:
        state = self.rank_state
        optimizer_bytes = state.master_bytes + state.optimizer_state_bytes
        touched = 2 * (state.param_bytes + state.grad_bytes + optimizer_bytes)
        optimizer_ms = 1e3 * touched / spec.memory_bytes_per_s if spec.memory_bytes_per_s else 0.0
        base = self._traced_at(micro_batch)
        blocks = tuple(replace(b, grad_bytes=self._block_grad_bytes) for b in base.blocks)
        profile = replace(
            base, blocks=blocks, param_bytes=state.param_bytes + state.gathered_bytes, bandwidths=_host_link(spec),
            grad_bytes=state.grad_bytes, optimizer_state_bytes=optimizer_bytes, buffer_bytes=state.buffer_bytes,
            optimizer_name=self.optimizer, optimizer_step_temp_bytes=self._step_temp_bytes(state),
        )
        timed = timed_for_device(profile, flops_per_s=self.mfu * spec.peak_bf16_flops_per_s, optimizer_ms=optimizer_ms,
                                 memory_bytes_per_s=spec.memory_bytes_per_s)
        if self.traced.whole:
            return timed
        return replicate_blocks(timed, self.traced.num_layers, name_format=self.traced.block_name_format)

    @cached_property
    def _block_grad_bytes(self) -> int:
        """Gradient bytes of one layer on this rank, for the planner's count of gradients live
        in backward. With gradient accumulation every gradient persists across micro-steps, so
        0: the planner then counts all of them as live for the whole backward."""
        if self.accumulation > 1 or self.traced.whole:
            return 0
        layer = model_state(self.traced.block_shapes, optimizer=self.optimizer, precision_name=self.precision)
        return shard_model_state(layer, world_size=self.world_size, zero_stage=self.zero_stage).grad_bytes

    def _step_temp_bytes(self, state: ModelState) -> int:
        """A fused optimizer step (``fused=True``, DeepSpeed FusedAdam) allocates nothing. PyTorch's
        foreach Adam (``foreach_optimizer``) allocates the square root of the second moment, one
        state element per parameter: half the moments' bytes."""
        adam = optimizer_layout(self.optimizer).name in ("adam", "adamw")
        return state.optimizer_state_bytes // 2 if adam and self.foreach_optimizer else 0

    def on_device(self, spec: DeviceSpec) -> DeviceEstimate:
        """Every strategy on ``spec``."""
        budget = self.allowance.max_allocated_bytes(spec.memory_bytes)
        rows = tuple(self._strategy(spec, name, budget) for name in self.strategies)
        return DeviceEstimate(device=spec, budget_bytes=budget, model_state=self.rank_state, strategies=rows)

    def _state_fits(self, budget: int) -> bool:
        return self.rank_state.total_bytes <= budget

    def _strategy(self, spec: DeviceSpec, name: str, budget: int) -> StrategyEstimate:
        profile = self.device_profile(self.micro_batch, spec)
        priced = price(profile, name, budget, search=self._state_fits(budget))
        pred = priced.plan.prediction
        opt_ms = profile.optimizer_step_ms
        row = StrategyEstimate(
            strategy=name, plan_strategy=priced.label, fits=priced.fits, peak_bytes=pred.peak_bytes,
            allowance_bytes=self.allowance.bytes_for(pred.peak_bytes),
            activation_bytes=pred.peak_bytes - _state_at_peak(profile, pred),
            peak_phase=pred.peak_phase, recompute_flops=pred.extra_flops,
            step_s=(self.accumulation * (pred.step_ms - opt_ms) + opt_ms) / 1e3,
            max_micro_batch=self._max_micro_batch(spec, name, budget) if self.traced.scalable else None,
        )
        if row.fits and row.max_micro_batch is not None and row.max_micro_batch < self.micro_batch:
            row = replace(row, max_micro_batch=self.micro_batch)  # optimal's bound is a lower bound
        return replace(row, diagnosis="" if row.fits else self._diagnose(spec, row, budget))

    def _max_micro_batch(self, spec: DeviceSpec, name: str, budget: int) -> int:
        key = (spec.name, name, budget)
        if key not in self._max_cache:
            self._max_cache[key] = self._search_max_micro_batch(spec, name, budget)
        return self._max_cache[key]

    @cached_property
    def _max_cache(self) -> dict[tuple[str, str, int], int]:
        return {}

    def _search_max_micro_batch(self, spec: DeviceSpec, name: str, budget: int) -> int:
        if not self._state_fits(budget):
            return 0
        if name != "optimal":
            return _largest(lambda b: price(self.device_profile(b, spec), name, budget).fits)
        others = [self._max_micro_batch(spec, other, budget) for other in ("none", "full", "selective")]
        lowest = OptimalSearch(conservative(self.device_profile(2, spec))).min_peak_segments()
        fits = _layout_fits(lambda b: self.device_profile(b, spec), lowest, budget)
        return max(others + [_largest(lambda b: fits(max(b, 2)))])

    def _diagnose(self, spec: DeviceSpec, row: StrategyEstimate, budget: int) -> str:
        if not self._state_fits(budget):
            return explain_state_overflow(
                self.unsharded_state, self.rank_state, budget_bytes=budget, device=spec, optimizer=self.optimizer,
                world_size=self.world_size, zero_stage=self.zero_stage, param_count=self.traced.param_count,
                unit_state=model_state(self.traced.unit_shapes, optimizer=self.optimizer, precision_name=self.precision),
            )
        return explain_activation_overflow(row, self.rank_state, budget_bytes=budget, device=spec,
                                           micro_batch=self.micro_batch)


def _host_link(spec: DeviceSpec) -> Bandwidths:
    """Offload to host memory over the device's host link, both directions at the datasheet rate,
    none of it assumed hidden behind compute (the planner then offloads only where memory needs it)."""
    rate = spec.host_link_bytes_per_s
    return Bandwidths(host_to_device_bytes_per_s=rate, device_to_host_bytes_per_s=rate, overlap_fraction=0.0)


def _layout_fits(profile_at: Callable[[int], Profile], segments: tuple[Segment, ...], budget: int) -> Callable[[int], bool]:
    return lambda b: predict(profile_at(b), segments).peak_bytes <= budget


def _largest(fits: Callable[[int], bool]) -> int:
    """Largest ``b`` in 1..MAX_MICRO_BATCH with ``fits(b)``, ``fits`` true up to some point (0: none)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_MICRO_BATCH and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_MICRO_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _state_at_peak(profile: Profile, prediction: Prediction) -> int:
    """Model state counted in the peak: parameters, buffers, optimizer state and the gradients
    live at that moment (`remat.plan.predict.grad_bytes_live`; all of them in the optimizer step)."""
    state = profile.param_bytes + profile.buffer_bytes + profile.optimizer_state_bytes
    if prediction.peak_phase == "optimizer":
        return state + profile.grad_bytes
    index = profile.num_blocks if prediction.peak_phase == "post" else max(prediction.peak_block, 0)
    return state + grad_bytes_live(profile, index)


__all__ = ["MAX_MICRO_BATCH", "Pricing"]
