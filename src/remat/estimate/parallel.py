"""The parallel layout of a training job: data, tensor (and sequence), pipeline, context, expert.

GPUs = data x tensor x pipeline x context (Megatron-LM's order of process groups, tensor
innermost: ``megatron/core/parallel_state.py``, ``order="tp-cp-ep-dp-pp"``). Expert parallelism
folds into the data x context x tensor ranks of a stage, as Megatron-Core's MoE "parallel
folding" does: a routed expert's weights are split over expert_tensor x expert ranks and its
optimizer state over the remaining ``expert_data`` ranks (`Parallelism.expert_data`,
``expert_data_parallel_size`` of ``megatron/training/theoretical_memory_usage.py``).

What each one divides, per GPU (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Table 2 and section 4):

- tensor t: the weights of column- and row-parallel linears, the embedding and head (over the
  vocabulary), and the activations between them; norms, residuals, dropout masks and the linears'
  inputs stay whole: per layer ``sbh(10 + 24/t + 5as/(ht))`` bytes for a GPT layer;
- sequence parallelism (with t > 1): the whole activations along the sequence too:
  ``sbh(34/t + 5as/(ht))``;
- pipeline p: the layers, ``L/p`` per stage, or an uneven split where ``p`` does not divide
  ``L`` (Megatron-LM's ``--decoder-first-pipeline-num-layers`` and ``--decoder-last-pipeline-num-layers``:
  the first and last stages' counts given, the rest even over the stages between; Llama 3 405B's
  126 layers over 16 stages put 7 on the first and the last, 8 on each other, `Parallelism.stage_sizes`);
  with 1F1B stage ``k`` holds the activations of ``min(m, p - k)`` micro-batches (section 4.2.3),
  with the interleaved schedule of ``v`` chunks per stage the first
  ``p (1 + (p - 1)/(p v))`` (Megatron-LM's ``interleaved_schedule_memory_penalty``) and the last
  ``((v - 1) p + 1)/v``, as the schedule's warm-up runs them (`Parallelism.in_flight_at`);
- context c: every token-indexed activation along the sequence (each rank holds ``s/c`` tokens);
- expert e: the routed experts' weights; their activations follow the tokens a rank receives,
  the mean share times ``expert_load`` (1: a balanced router, the default assumption).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class Parallelism:
    """How one training job spreads over GPUs."""

    data: int = 1
    """Data-parallel replicas d."""
    tensor: int = 1
    """Tensor-parallel size t."""
    sequence_parallel: bool = False
    """Split the activations outside the tensor-parallel region along the sequence (needs t > 1)."""
    pipeline: int = 1
    """Pipeline stages p."""
    virtual_stages: int = 1
    """Model chunks per stage v: the interleaved 1F1B schedule when above 1 (needs p > 1)."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage; None: as many as on the stages between (`stage_sizes`)."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage; None: as many as on the stages between (`stage_sizes`)."""
    context: int = 1
    """Context-parallel size c."""
    expert: int = 1
    """Expert-parallel size e (routed experts of MoE layers)."""
    expert_tensor: int | None = None
    """Tensor-parallel size of the routed experts; None: t (Megatron-LM's default)."""
    expert_load: float = 1.0
    """Tokens routed to the busiest expert rank over the mean: 1.0 assumes a balanced router."""

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "virtual_stages", "context", "expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.expert_tensor is not None and (not isinstance(self.expert_tensor, int) or self.expert_tensor < 1):
            raise ValueError(f"expert_tensor must be an integer >= 1 or None (= tensor), got {self.expert_tensor!r}.")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence parallelism splits the tensor-parallel ranks' activations: it needs "
                             "tensor parallelism above 1; pass --tensor-parallel T with T > 1 or drop --sequence-parallel.")
        if self.virtual_stages > 1 and self.pipeline == 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} interleaves pipeline stages: it needs "
                             "pipeline parallelism above 1; pass --pipeline-parallel P with P > 1.")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 or None (as many as the stages between), got {value!r}.")
            if self.pipeline == 1:
                raise ValueError(f"{name}={value} sets a pipeline stage's layers: it needs pipeline parallelism above 1; "
                                 f"pass --pipeline-parallel P with P > 1 or drop {flag}.")
        if not self.expert_load >= 1.0:
            raise ValueError(f"expert_load must be >= 1.0 (the busiest expert rank's tokens over the mean), "
                             f"got {self.expert_load}; 1.0 is a balanced router.")

    @property
    def gpus(self) -> int:
        """All GPUs of the job."""
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def expert_tensor_size(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @property
    def expert_data(self) -> int:
        """Ranks that hold the same routed-expert shard (their optimizer state is sharded over them)."""
        return self.tensor * self.context * self.data // (self.expert_tensor_size * self.expert)

    @property
    def sequence_divisor(self) -> int:
        """What divides the activations outside the tensor-parallel region: t under sequence
        parallelism, else 1."""
        return self.tensor if self.sequence_parallel else 1

    @property
    def uneven(self) -> bool:
        """The first or the last stage has its own layer count."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_sizes(self, num_layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage, first to last: ``L/p`` each, or the first and the last as
        given and the rest evenly over the stages between (Megatron-LM's uneven split). Raises
        ValueError, with counts that would split, when the layers do not."""
        p, v = self.pipeline, self.virtual_stages
        if not self.uneven:
            if num_layers % (p * v):
                raise ValueError(f"{num_layers} layers do not split evenly over {p} pipeline stage(s) x {v} chunk(s) = "
                                 f"{p * v}; pick --pipeline-parallel (and --virtual-stages) dividing the layer count"
                                 + (f", or give the first and last stages their own: {uneven_hint(num_layers, p)}"
                                    if v == 1 and uneven_hint(num_layers, p) else "") + ".")
            return (num_layers // p,) * p
        ends = [n for n in (self.first_stage_layers, self.last_stage_layers) if n is not None]
        between = p - len(ends)
        rest = num_layers - sum(ends)
        if rest < 0 or (between == 0 and rest) or (between and (rest == 0 or rest % between)):
            given = ", ".join(f"{n} on the {w} stage" for n, w in zip((self.first_stage_layers, self.last_stage_layers),
                                                                        ("first", "last")) if n is not None)
            hint = uneven_hint(num_layers, p)
            raise ValueError(f"{num_layers} layers over {p} pipeline stages with {given}: the other {rest} do not split "
                             f"evenly over the {between} stage(s) left" + (f"; for example {hint}" if hint else "")
                             + ".")
        middle = rest // between if between else 0
        first = self.first_stage_layers if self.first_stage_layers is not None else middle
        last = self.last_stage_layers if self.last_stage_layers is not None else middle
        sizes = (first,) + (middle,) * (p - 2) + (last,)
        if any(n % v for n in sizes):
            raise ValueError(f"{num_layers} layers as {'/'.join(map(str, dict.fromkeys(sizes)))} a stage over {v} "
                             f"chunks each: every stage's layers must split into the {v} chunks of the interleaved "
                             f"schedule; pick --first-stage-layers and --last-stage-layers that {v} divides, or drop "
                             "--virtual-stages.")
        return sizes

    def in_flight_at(self, stage: int, micro_batches: int) -> float:
        """Micro-batches whose activations stage ``stage`` holds at its peak, as Megatron-LM's
        schedules run them (``megatron/core/pipeline_parallel/schedules.py``): with 1F1B
        ``min(m, p - stage)`` (Korthikanti et al. 2022, section 4.2.3); interleaved, a stage runs
        ``2 (p - stage - 1) + (v - 1) p`` chunk forwards before its first backward, and one more,
        each a ``1/v`` of its layers (the first stage: ``p (1 + (p - 1)/(p v))``, `in_flight`; the
        last ``((v - 1) p + 1)/v``); with ``m = p`` every forward runs first, ``m`` on every stage."""
        p, v, m = self.pipeline, self.virtual_stages, micro_batches
        if p == 1:
            return 1.0
        if v == 1:
            return float(min(m, p - stage))
        if m == p:
            return float(m)
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v) / v

    @property
    def interleaved(self) -> bool:
        return self.virtual_stages > 1

    def in_flight(self, micro_batches: int) -> float:
        """Micro-batches whose activations the first pipeline stage holds at its peak (the
        start of its first backward): 1 without a pipeline; ``min(m, p)`` with 1F1B;
        ``p (1 + (p - 1)/(p v))`` interleaved (Korthikanti et al. 2022, section 4.2.3;
        ``megatron/training/theoretical_memory_usage.py``, ``compute_activation_memory``), ``m``
        where ``m = p`` (`in_flight_at`)."""
        return self.in_flight_at(0, micro_batches)

    def check_experts(self) -> None:
        """The routed experts fold into the tensor x context x data ranks of a stage."""
        split = self.expert_tensor_size * self.expert
        if (self.tensor * self.context * self.data) % split:
            raise ValueError(
                f"expert tensor x expert parallel = {self.expert_tensor_size} x {self.expert} = {split} must divide "
                f"tensor x context x data = {self.tensor * self.context * self.data} (the ranks of a stage the experts "
                "fold into); change --expert-parallel or the data-parallel size.")

    def check_micro_batches(self, micro_batches: int) -> None:
        """The interleaved schedule needs the micro-batches to fill every stage in rounds of p."""
        if self.interleaved and micro_batches % self.pipeline:
            raise ValueError(
                f"the interleaved schedule runs micro-batches in rounds of the {self.pipeline} stages: "
                f"{micro_batches} micro-batch(es) per step is not a multiple of {self.pipeline}; "
                "pass --grad-accum (micro-batches per step) as a multiple of --pipeline-parallel.")

    def describe(self) -> str:
        """A short label, e.g. ``"dp8 tp8+sp pp4 (v2)"``, ``"dp128 tp8+sp pp16 (first 7, last 7)"``."""
        parts = [f"dp{self.data}"]
        if self.tensor > 1:
            parts.append(f"tp{self.tensor}" + ("+sp" if self.sequence_parallel else ""))
        if self.pipeline > 1:
            parts.append(f"pp{self.pipeline}" + (f" (v{self.virtual_stages})" if self.interleaved else "")
                         + (" (" + ", ".join(f"{w} {n}" for w, n in (("first", self.first_stage_layers),
                                                                        ("last", self.last_stage_layers)) if n is not None)
                            + ")" if self.uneven else ""))
        if self.context > 1:
            parts.append(f"cp{self.context}")
        if self.expert > 1:
            parts.append(f"ep{self.expert}")
        return " ".join(parts)


def uneven_hint(num_layers: int, pipeline: int) -> str:
    """Options giving ``num_layers`` an uneven split over ``pipeline`` stages, ``ceil(L/p)`` on
    each stage between and the rest shared by the first and the last (the first one more when
    odd); empty when there is none."""
    split = uneven_split(num_layers, pipeline)
    if split is None:
        return ""
    first, last = split
    middle = (num_layers - first - last) // (pipeline - 2) if pipeline > 2 else 0
    between = "" if pipeline == 2 else f", {middle} on the stage between" if pipeline == 3 else \
        f", {middle} on each of the {pipeline - 2} between"
    return f"--first-stage-layers {first} --last-stage-layers {last} ({first} + {last} layers{between})"


def uneven_split(num_layers: int, pipeline: int) -> tuple[int, int] | None:
    """(first, last) stage layers with ``ceil(L/p)`` on each stage between, the first and last
    at most that and at least one; None when ``p`` divides ``L`` or no such split exists."""
    if pipeline < 2 or num_layers % pipeline == 0:
        return None
    middle = -(-num_layers // pipeline)
    rest = num_layers - (pipeline - 2) * middle
    if rest < 2 or rest > 2 * middle:
        return None
    return -(-rest // 2), rest // 2


__all__ = ["Parallelism", "uneven_hint", "uneven_split"]
