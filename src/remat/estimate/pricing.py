"""Price each strategy on each device: per GPU, the stages' model state, peaks and step time.

A `Pricing` holds what is fixed across devices (the traced model, the micro-batch, the state
recipe, the parallel layout) and builds, per micro-batch, the pipeline stages a GPU can run:
the first (the embedding, the most micro-batches in flight) and the last (the head and loss);
one stage without a pipeline. Each layer is the traced layer divided by the layout
(`remat.estimate.layers.on_gpu`); model state is `remat.estimate.sharding.gpu_state`. A strategy
is chosen per stage (`remat.estimate.strategies.choose`), the peak is the higher stage's
(`remat.estimate.stage.stage_peak`) and the step runs at the slower stage's pace:

    step = m x (compute + communication of one micro-batch) + bubble + data-parallel traffic
           not hidden + optimizer step at memory bandwidth

with compute = (forward + backward + replayed FLOPs) / (MFU x peak FLOP/s) (`remat.estimate.stage`)
and the communication terms of `remat.estimate.comms`.

Largest micro-batch: every byte is affine in the micro-batch, so a doubling then bisection
search finds it in about 2 log2(b) pricings, for ``optimal`` too (its mix is searched again at
each micro-batch: milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

from remat.estimate.comms import Network, bubble_s, data_parallel_s
from remat.estimate.devices import DeviceSpec
from remat.estimate.explain import explain_activation_overflow, explain_state_overflow
from remat.estimate.head import HeadOnGpu
from remat.estimate.layers import LayerOnGpu, on_gpu, per_gpu
from remat.estimate.parallel import Parallelism
from remat.estimate.results import DeviceEstimate, HeadEstimate, StepTime, StrategyEstimate
from remat.estimate.sharding import RoleShapes, StateRecipe, gpu_state, largest_unit, part_grad_bytes, stage_layers
from remat.estimate.shares import Segment, Split, untokenized
from remat.estimate.stage import Rates, Stage, StagePeak, StageTime, stage_peak, stage_time
from remat.estimate.strategies import Choice, choose
from remat.estimate.trace import Traced
from remat.memory.allowance import Allowance
from remat.memory.diagnose import format_gib
from remat.memory.model_state import ModelState
from remat.memory.optimizer_state import optimizer_layout

MAX_MICRO_BATCH = 1 << 16
DEFAULT_NETWORK_BYTES_PER_S = 50e9
"""Between nodes, per GPU, one direction, when neither the device nor the user says: 400 Gb/s,
one NVIDIA ConnectX-7 InfiniBand NDR port per GPU as in a DGX H100 (NVIDIA DGX H100 datasheet,
https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx: "8x single-port NVIDIA
ConnectX-7 VPI, 400Gb/s InfiniBand/Ethernet")."""


@dataclass(kw_only=True, frozen=True)
class PostPart:
    """The part after the layers (final norm, head, loss) on one GPU of the last stage, per micro-batch."""

    saved_bytes: float = 0.0
    """Held from its forward to its backward."""
    working_bytes: float = 0.0
    """Needed on top while its backward runs."""
    flops: float = 0.0
    """Forward FLOPs."""
    bwd_flops: float = 0.0
    """Backward FLOPs."""
    replay_flops: float = 0.0
    """FLOPs the head's strategy runs again in the backward."""
    moved_bytes: float = 0.0
    """Bytes the head's chunks read and write (priced at memory bandwidth)."""


@dataclass(kw_only=True, frozen=True)
class Pricing:
    """Everything fixed across devices; builds the stages and prices strategies."""

    traced: Traced
    """The model."""
    micro_batch: int
    """Sequences per micro-batch."""
    micro_batches: int
    """Micro-batches per optimizer step per pipeline (gradient accumulation)."""
    recipe: StateRecipe
    """Optimizer, precision, ZeRO stage, gradient dtype."""
    parallelism: Parallelism
    """The layout."""
    mfu: float
    """Share of peak FLOP/s reached."""
    allowance: Allowance
    """Memory set aside beyond tensors."""
    strategies: tuple[str, ...]
    """Strategies to price, in order."""
    network_bytes_per_s: float | None = None
    """Between nodes, per GPU, one direction (None: the device's, else `DEFAULT_NETWORK_BYTES_PER_S`)."""
    foreach_optimizer: bool = False
    """Count the temporaries of PyTorch's foreach Adam step (default: a fused step, none)."""
    head: str = "keep"
    """How the head runs on the last stage (`remat.estimate.head`): ``keep``, ``recompute``,
    ``chunked`` or ``chunked:<tokens>``."""

    # -- the stages ------------------------------------------------------------------------
    def split(self, micro_batch: int) -> Split:
        """The traced shares at ``micro_batch``. At micro-batch 1 without a sequence split the
        constant part is divided as the per-token part is, so the traces at 2 and 3 that tell
        them apart are skipped (a configuration whose model state alone does not fit never
        needs them)."""
        key = ("split", micro_batch)
        if key not in self._cache:
            par = self.parallelism
            unsplit = micro_batch == 1 and par.sequence_divisor == 1 and par.context == 1
            self._cache[key] = untokenized(self.traced.flow(1)) if unsplit else self.traced.split(micro_batch)
        return self._cache[key]

    @cached_property
    def _cache(self) -> dict:
        return {}

    def layer(self, micro_batch: int, kind: int) -> LayerOnGpu:
        """Traced layer ``kind`` on one GPU."""
        split = self.split(micro_batch)
        return on_gpu(split.per_token.layers[kind], split.constant.layers[kind], self.parallelism)

    def stage_indices(self) -> tuple[int, ...]:
        """The stages priced: the first and the last (one without a pipeline); with an uneven
        split also the second, which holds the most micro-batches of the stages between (their
        layers alike, the others hold no more and run as long)."""
        p = self.parallelism.pipeline
        return tuple(sorted({0, p - 1} | ({1} if self.parallelism.uneven and p > 2 else set())))

    def stages(self, micro_batch: int) -> tuple[Stage, ...]:
        key = ("stages", micro_batch)
        if key not in self._cache:
            self._cache[key] = tuple(self._stage(micro_batch, k) for k in self.stage_indices())
        return self._cache[key]

    def _stage(self, micro_batch: int, index: int) -> Stage:
        par, split = self.parallelism, self.split(micro_batch)
        kinds = [self.traced.layer_kinds[i] for i in stage_layers(self.traced.num_layers, par, index)]
        by_kind = {k: self.layer(micro_batch, k) for k in set(kinds)}
        first, last = index == 0, index == par.pipeline - 1
        post = self._post(micro_batch) if last else PostPart()
        pre = _divided(split.per_token.pre, split.constant.pre, par) if first else (0.0, 0.0, 0.0, 0.0)
        pre_forward = _scaled_like_saved(split.per_token.pre, split.constant.pre, par,
                                         "forward_peak_bytes") if first else 0.0
        layers = tuple(by_kind[k] for k in kinds)
        return Stage(
            index=index, first=first, last=last, state=self.state(index), layers=layers,
            pre_bytes=pre[0], pre_working_bytes=pre[1], pre_forward_peak_bytes=pre_forward, pre_flops=pre[2],
            pre_bwd_flops=pre[3],
            pre_released=self._released(micro_batch, kinds) if first else (),
            post_saved_bytes=post.saved_bytes, post_working_bytes=post.working_bytes, post_flops=post.flops,
            post_bwd_flops=post.bwd_flops, post_replay_flops=post.replay_flops, post_moved_bytes=post.moved_bytes,
            in_flight=par.in_flight_at(index, self.micro_batches),
            buffer_bytes=2 * layers[-1].hidden_bytes / par.sequence_divisor if par.pipeline > 1 and layers else 0.0,
            optimizer_temp_bytes=self._step_temp_bytes(self.state(index)), **self._grads(index),
        )

    def _released(self, micro_batch: int, kinds: list[int]) -> tuple[tuple[float, float], ...]:
        """Per layer of the first stage, (bytes, of them no op saves) of the part before the layers
        that its backward frees (`remat.estimate.shares.Segment.released`): what a traced layer
        frees, the first layer copying it (or its twin, the traced layer after it) frees; what a
        traced layer no layer of the stage copies frees, the stage's first layer (a bound)."""
        split, par = self.split(micro_batch), self.parallelism
        out = [[0.0, 0.0] for _ in kinds]
        for traced, (per, const) in enumerate(zip(split.per_token.layers, split.constant.layers)):
            where = next((kinds.index(k) for k in (traced, traced + 1) if k in kinds), 0)
            out[where][0] += per_gpu(per.released, const.released, par)
            out[where][1] += per_gpu(per.released_unsaved, const.released_unsaved, par)
        return tuple((a, b) for a, b in out)

    def _post(self, micro_batch: int) -> PostPart:
        """The part after the layers on one GPU: the traced part divided by the layout, with the
        head priced by its byte model under ``self.head`` (`remat.estimate.head`: rest + held, and
        rest + the head's peak)."""
        split, par = self.split(micro_batch), self.parallelism
        saved, working, flops, bwd_flops = _divided(split.per_token.post, split.constant.post, par)
        on = self.head_on_gpu(micro_batch)
        if on is None:
            return PostPart(saved_bytes=saved, working_bytes=working, flops=flops, bwd_flops=bwd_flops)
        rest = self.rest_on_gpu(micro_batch)
        # what the rest's own backward needs beyond the head's (UltraBERT's two-layer prediction MLP
        # before its projection, 1280 wide: 6.1 % under without it): the traced working set less the
        # model's own head's, where that is more than the loss's scalars, which the traced step
        # holds at another moment of the head's backward than its peak (below 1 % of it)
        keep = self.head_on_gpu(micro_batch, "keep")
        head_working = keep.peak_bytes - keep.held_bytes
        rest_working = working - head_working if working > REST_WORKING_FLOOR * head_working else 0.0
        return PostPart(saved_bytes=rest + on.held_bytes, working_bytes=on.peak_bytes - on.held_bytes + rest_working,
                        flops=flops, bwd_flops=bwd_flops, replay_flops=float(on.replay_flops),
                        moved_bytes=float(on.moved_bytes))

    def rest_on_gpu(self, micro_batch: int) -> float:
        """The rest of the part after the layers (a final norm) on one GPU: whole, per token."""
        par = self.parallelism
        return self._rest_bytes(micro_batch) / (par.sequence_divisor * par.context)

    def head_estimates(self, heads: tuple[str, ...]) -> tuple[HeadEstimate, ...]:
        """Each of ``heads`` on one GPU of the last stage at the micro-batch (none without a head part)."""
        b = self.micro_batch
        if self.head_on_gpu(b, "keep") is None:
            return ()
        out: dict[str, HeadEstimate] = {}
        for name in heads:
            on = self.head_on_gpu(b, name)
            out.setdefault(on.strategy, HeadEstimate(
                strategy=on.strategy, logits_bytes=on.logits_bytes, held_bytes=int(on.held_bytes),
                fwd_peak_bytes=int(on.fwd_peak_bytes), bwd_peak_bytes=int(on.bwd_peak_bytes),
                post_peak_bytes=int(self.rest_on_gpu(b) + on.peak_bytes), replay_flops=on.replay_flops,
                moved_bytes=on.moved_bytes))
        return tuple(out.values())

    def _rest_bytes(self, micro_batch: int) -> float:
        """What the part after the layers saves besides the model's own head (a final norm), whole model."""
        split = self.split(micro_batch)
        traced = split.per_token.post.saved.total + split.constant.post.saved.total
        return traced - self.traced.head.model_saved_bytes(micro_batch)

    def with_head(self, head: str) -> Pricing:
        """The same pricing with the head under ``head``, sharing what the head does not change."""
        other = replace(self, head=head)
        other._cache.update({k: v for k, v in self._cache.items() if k[0] != "stages"})
        return other

    @property
    def head_name(self) -> str:
        """The head strategy priced, ``chunked`` resolved to its chunk size at the micro-batch."""
        on = self.head_on_gpu(self.micro_batch)
        return "keep" if on is None else on.strategy

    def head_on_gpu(self, micro_batch: int, head: str | None = None) -> HeadOnGpu | None:
        """The head under ``head`` (default ``self.head``) on one GPU of the last stage; None when
        the model has none to price, or when its traced part after the layers saves less than the
        model's own head would (a head the byte model does not describe: priced as traced)."""
        name = self.head if head is None else head
        if self.traced.head is None or self._rest_bytes(micro_batch) < 0:
            if name != "keep":
                why = self.traced.head_note or "its head saves other tensors than a projection and token cross-entropy"
                raise ValueError(f"head strategy {name!r} needs an LM head remat can price, and {self.traced.label} "
                                 f"has none ({why}); estimate it with head 'keep'.")
            return None
        return self.traced.head.on_gpu(name, micro_batch, self.parallelism)

    def _grads(self, index: int) -> dict:
        """Per-layer and pre-part gradient bytes when gradients appear as the backward makes them:
        one micro-batch per step, no pipeline (`remat.estimate.stage`); else none (all live)."""
        if self.micro_batches > 1 or self.parallelism.pipeline > 1:
            return {}
        key = ("grads", index)
        if key not in self._cache:
            self._cache[key] = self._grad_bytes(index)
        return self._cache[key]

    def _grad_bytes(self, index: int) -> dict:
        params, par = self.traced.params, self.parallelism
        layers = [params.layers[i] for i in stage_layers(self.traced.num_layers, par, index)]
        grads = [float(part_grad_bytes(x, par, self.recipe)) for x in layers]
        pre = float(sum(part_grad_bytes(x, par, self.recipe) for x in (params.pre, params.tied)))
        for layer, shapes in self.traced.gap_grads + self.traced.between_grads:  # made after that layer's backward
            between = float(part_grad_bytes(shapes, par, self.recipe))
            grads[layer] += between
            pre -= between
        for layer, shapes in self.traced.shared_grads:  # made in that layer's backward, not the pre part's
            grads[layer] += float(part_grad_bytes(shapes, par, self.recipe))
        return dict(layer_grad_bytes=tuple(grads), pre_grad_bytes=pre)

    def state(self, index: int, zero_stage: int | None = None) -> ModelState:
        """Model state on one GPU of stage ``index`` (at ``zero_stage``, default the recipe's)."""
        key = ("state", index, zero_stage)
        if key not in self._cache:
            recipe = self.recipe if zero_stage is None else replace(self.recipe, zero_stage=zero_stage)
            t, par = self.traced, self.parallelism
            layers = stage_layers(t.num_layers, par, index)
            buffers = (sum(t.layer_buffer_bytes[t.layer_kinds[i]] for i in layers)
                       + (t.fixed_buffer_bytes if index == 0 else 0))
            state = gpu_state(t.params, par, index, recipe, buffer_bytes=buffers)
            if t.layer_quantized_bytes and recipe.zero_stage == 3 and par.data > 1:
                # FSDP-QLoRA: the NF4 weights are sharded as the layers' other weights are and gathered
                # with their unit (this layer's and, prefetched, the next one's: `gathered_unit_bytes`)
                nf4 = [t.layer_quantized_bytes[t.layer_kinds[i]] for i in layers]
                state = replace(state, buffer_bytes=buffers - sum(nf4) + -(-sum(nf4) // par.data),
                                gathered_bytes=state.gathered_bytes + 2 * max(nf4, default=0))
            self._cache[key] = state
        return self._cache[key]

    def _step_temp_bytes(self, state: ModelState) -> int:
        """A fused optimizer step (``fused=True``, DeepSpeed FusedAdam) allocates nothing. PyTorch's
        foreach Adam (``foreach_optimizer``) allocates the square root of the second moment, one
        state element per parameter: half the moments' bytes."""
        adam = optimizer_layout(self.recipe.optimizer).name in ("adam", "adamw")
        return state.optimizer_state_bytes // 2 if adam and self.foreach_optimizer else 0

    @cached_property
    def heaviest_stage(self) -> int:
        """The stage whose GPUs hold the most model state."""
        return max(self.stage_indices(), key=lambda k: self.state(k).total_bytes)

    @cached_property
    def heaviest_state(self) -> ModelState:
        """The model state of the stage that holds the most."""
        return self.state(self.heaviest_stage)

    @cached_property
    def optimizer_touched_bytes(self) -> int:
        """What the optimizer step reads and writes on the stage that holds the most: the weights it
        updates, their gradients, master copy and state, each read and written once. Weights without
        a gradient are not updated: LoRA's frozen base (2 x 15 GiB of Llama-3-8B's bf16 weights were
        counted, 10 ms a step on an H100; 2 x 131 GiB of Llama-3-70B's, 82 ms)."""
        state = self.trained_state(self.heaviest_stage)
        return 2 * (state.param_bytes + state.grad_bytes + state.master_bytes + state.optimizer_state_bytes)

    def trained_state(self, index: int, zero_stage: int | None = None) -> ModelState:
        """`state` of the parameters with a gradient alone (what the optimizer updates)."""
        recipe = self.recipe if zero_stage is None else replace(self.recipe, zero_stage=zero_stage)
        trained = replace(self.traced.params, gradless=RoleShapes(), layer_gradless=())
        return gpu_state(trained, self.parallelism, index, recipe)

    # -- pricing on a device -----------------------------------------------------------------
    def network(self, spec: DeviceSpec) -> Network:
        net = self.network_bytes_per_s or spec.network_bytes_per_s or DEFAULT_NETWORK_BYTES_PER_S
        link = spec.gpu_link_bytes_per_s or spec.host_link_bytes_per_s or net
        return Network(intra_node_bytes_per_s=link, inter_node_bytes_per_s=net, gpus_per_node=spec.gpus_per_node or 8)

    def rates(self, spec: DeviceSpec) -> Rates:
        return Rates(flops_per_s=self.mfu * spec.peak_flops_per_s(self.recipe.precision),
                     memory_bytes_per_s=spec.memory_bytes_per_s,
                     host_link_bytes_per_s=spec.host_link_bytes_per_s)

    def on_device(self, spec: DeviceSpec) -> DeviceEstimate:
        """Every strategy on ``spec``."""
        budget = self.allowance.max_allocated_bytes(spec.memory_bytes)
        rows = tuple(self._row(spec, name, budget) for name in self.strategies)
        return DeviceEstimate(device=spec, budget_bytes=budget, model_state=self.heaviest_state, strategies=rows)

    def price(self, spec: DeviceSpec, strategy: str, micro_batch: int, budget: float) -> Priced:
        """``strategy`` on every stage at ``micro_batch``."""
        net, rates, par = self.network(spec), self.rates(spec), self.parallelism
        stages = self.stages(micro_batch)
        choices = tuple(choose(s, strategy, budget, rates=rates, par=par, net=net) for s in stages)
        peaks = tuple(stage_peak(s, c.costs) for s, c in zip(stages, choices))
        times = tuple(stage_time(s, c.costs, rates, par=par, net=net, facts=self.traced.facts)
                      for s, c in zip(stages, choices))
        return Priced(stages=stages, choices=choices, peaks=peaks, time=self._step(spec, times, net))

    def _step(self, spec: DeviceSpec, times: tuple[StageTime, ...], net: Network) -> StepTime:
        slowest = max(times, key=lambda t: t.total_s)
        m, zero = self.micro_batches, self.recipe.zero_stage
        whole = self.state(0, zero_stage=0)
        traffic = data_parallel_s(param_bytes=whole.param_bytes, grad_bytes=whole.grad_bytes, zero_stage=zero,
                                  par=self.parallelism, net=net)
        exposed = m * max(0.0, traffic - slowest.compute_s) if zero == 3 else max(0.0, traffic - slowest.backward_s)
        touched = self.optimizer_touched_bytes
        return StepTime(compute_s=m * slowest.compute_s, comm_s=m * slowest.comm_s,
                        bubble_s=bubble_s(self.parallelism, slowest.total_s), data_parallel_s=exposed,
                        optimizer_s=touched / spec.memory_bytes_per_s if spec.memory_bytes_per_s else 0.0)

    def _row(self, spec: DeviceSpec, name: str, budget: int) -> StrategyEstimate:
        priced = self.price(spec, name, self.micro_batch, budget)
        k = max(range(len(priced.peaks)), key=lambda i: priced.peaks[i].peak_bytes)
        peak, stage, choice = priced.peaks[k], priced.stages[k], priced.choices[k]
        state = stage.state.total_bytes
        row = StrategyEstimate(
            strategy=name, plan_strategy=choice.label, fits=peak.peak_bytes <= budget,
            peak_bytes=int(peak.peak_bytes), allowance_bytes=self.allowance.bytes_for(int(peak.peak_bytes)),
            activation_bytes=int(peak.peak_bytes - state), peak_phase=peak.phase,
            recompute_flops=int(sum(c.extra_flops for c in choice.costs) + (stage.post_replay_flops if stage.last else 0)),
            step_s=priced.time.total_s,
            max_micro_batch=self.max_micro_batch(spec, name, budget) if self.traced.scalable else None,
            peak_stage=stage.index, layer_retained_bytes=int(_mean(c.retained_bytes for c in choice.costs)),
            held_bytes=int(peak.held_bytes), working_bytes=int(peak.working_bytes), time=priced.time,
        )
        return row if row.fits else replace(row, diagnosis=self._diagnose(spec, row, budget, stage.index))

    def fits(self, spec: DeviceSpec, name: str, micro_batch: int, budget: float) -> bool:
        priced = self.price(spec, name, micro_batch, budget)
        return all(p.peak_bytes <= budget for p in priced.peaks)

    def max_micro_batch(self, spec: DeviceSpec, name: str, budget: int) -> int:
        """The largest micro-batch with which ``name`` fits (0: none)."""
        if any(self.state(k).total_bytes > budget for k in self.stage_indices()):
            return 0
        return _largest(lambda b: self.fits(spec, name, b, budget))

    def _diagnose(self, spec: DeviceSpec, row: StrategyEstimate, budget: int, index: int) -> str:
        rank = self.state(index)
        if rank.total_bytes > budget:
            unit = largest_unit(self.traced.params, self.parallelism, index, self.recipe)
            return explain_state_overflow(
                self.state(index, zero_stage=0), rank, budget_bytes=budget, device=spec, optimizer=self.recipe.optimizer,
                world_size=self.parallelism.data, zero_stage=self.recipe.zero_stage,
                param_count=_param_count(self.trained_state(index, zero_stage=0), self.recipe), unit_state=unit,
            ) + self._frozen_hint(index)
        text = explain_activation_overflow(row, rank, budget_bytes=budget, device=spec, micro_batch=self.micro_batch)
        return text + self._head_hint(row, budget)

    def _frozen_hint(self, index: int) -> str:
        """Where most of the weights take no gradient (LoRA's frozen base in the model's dtype), what
        QLoRA would hold them in ("" otherwise)."""
        frozen = self.state(index, zero_stage=0).param_bytes - self.trained_state(index, zero_stage=0).param_bytes
        if not self.traced.lora or self.traced.quantized or frozen < self.state(index).total_bytes / 2:
            return ""
        return (f"\nOf the parameters, {format_gib(frozen)} take no gradient (LoRA's frozen base weights): "
                "--quantize nf4 holds every linear layer's but the head's in 4-bit NormalFloat, about 0.52 bytes "
                "an element (QLoRA).")

    def _head_hint(self, row: StrategyEstimate, budget: int) -> str:
        """What the chunked head would save when the peak is in the head's phase ("" otherwise):
        the peak is the head's when that saving brings it within ``budget``; else the layers'
        saved activations, held there too, are what to lower."""
        keep = self.head_on_gpu(self.micro_batch, "keep")
        if row.peak_phase != "head" or self.head != "keep" or keep is None:
            return ""
        chunked = self.head_on_gpu(self.micro_batch, "chunked")
        saving = keep.peak_bytes - chunked.peak_bytes
        if row.peak_bytes - saving <= budget:
            return (f" The peak is the LM head's: its logits are {format_gib(keep.logits_bytes)} per GPU, and --head "
                    f"chunked ({chunked.strategy}) peaks {format_gib(saving)} lower there, within the budget.")
        return (f" The peak falls in the LM head's phase, with every layer's saved activations still held: --head "
                f"chunked ({chunked.strategy}) peaks {format_gib(saving)} lower there (its logits are "
                f"{format_gib(keep.logits_bytes)} per GPU), still {format_gib(row.peak_bytes - saving - budget)} over; "
                "what the layers hold is what recomputation lowers.")


@dataclass(kw_only=True, frozen=True)
class Priced:
    """One strategy priced on every stage."""

    stages: tuple[Stage, ...]
    choices: tuple[Choice, ...]
    peaks: tuple[StagePeak, ...]
    time: StepTime


REST_WORKING_FLOOR = 1.01
"""The traced part after the layers needs more than the head's byte model in its backward by more
than this factor only where what runs before the projection has a backward of its own to pay for
(`Pricing._post`); below it, by a few bytes, the loss's scalars."""


def _divided(per_token: Segment, constant: Segment, par: Parallelism) -> tuple[float, float, float, float]:
    """(saved bytes, working bytes, forward FLOPs, backward FLOPs) of the part before or after the
    layers on one GPU."""
    saved = per_gpu(per_token.saved, constant.saved, par)
    working = _scaled_like_saved(per_token, constant, par, "working_bytes")
    return saved, working, per_gpu(per_token.flops, constant.flops, par), per_gpu(per_token.bwd_flops,
                                                                                  constant.bwd_flops, par)


def _scaled_like_saved(per_token: Segment, constant: Segment, par: Parallelism, name: str) -> float:
    """A byte figure of the part before or after the layers on one GPU, divided by the layout as
    its saved bytes are."""
    saved = per_gpu(per_token.saved, constant.saved, par)
    traced = per_token.saved.total + constant.saved.total
    return (getattr(per_token, name) + getattr(constant, name)) * (saved / traced if traced else 1.0)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _param_count(state: ModelState, recipe: StateRecipe) -> int:
    from remat.memory.model_state import precision

    return state.param_bytes // precision(recipe.precision).param_elem_bytes


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


__all__ = ["DEFAULT_NETWORK_BYTES_PER_S", "MAX_MICRO_BATCH", "PostPart", "Priced", "Pricing"]
