"""Which traced bytes and FLOPs tensor, sequence, context and expert parallelism divide.

`classify` runs one forward (with the loss) of a meta-device model under a dispatch mode that
follows Megatron-LM's tensor-parallel dataflow op by op (Shoeybi et al. 2019, section 3;
Korthikanti et al. 2022, section 4.2.1):

- a linear (a matmul or grouped matmul with a parameter operand) is column-parallel or
  row-parallel by the model's own tensor-parallel plan (``config.base_model_tp_plan`` of
  Hugging Face models: ``colwise`` / ``rowwise`` entries); a linear the plan does not list is
  whole on every rank (a MoE router, a latent projection). Without a plan, Megatron's pairing
  decides: column-parallel on a whole input, row-parallel on a split one;
- the head after the layers is column-parallel over the vocabulary and the token embedding
  vocabulary-parallel (Megatron's ``VocabParallelEmbedding``; its output is whole);
- an op's output is split when it is a column-parallel output, or when an input is split and
  it is not a row-parallel output (the row-parallel output is whole after its all-reduce).

Each storage autograd saves counts once, in the segment that saves it first; a layer counts only
what it makes itself and its own input, so a tensor made before the layers and passed to every
layer (rotary tables, masks, position ids, an encoder's output) counts once, before the layers.
The attention core is found as `remat.plan.policies` finds it (the last score matmul before a
softmax to the first matmul after it), keeping only what is computed from the scores; a fused
attention kernel is a core by itself. Its internals are the storages it makes, saves, and no op
after it reads: what Megatron-LM's selective recomputation frees (Korthikanti et al. 2022,
section 4.3: the softmax output, its dropout mask and output; a fused kernel's log-sum-exp).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat._batch import call_model, compute_loss
from remat.checkpointing.callsites import DirectCalls
from remat.estimate.shares import Flow, Segment, Share
from remat.measure.flops import op_flops
from remat.measure.storage import flat_tensors, storage_key, storage_nbytes, tensors_in

PRE, POST = "pre", "post"
GAP = "gap:"
"""Segment of what runs between two stacks of layers, named for the next stack's first layer."""
LINEAR_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm", "aten.matmul",
                        "aten.linear", "aten.convolution", "aten._convolution"})
DEQUANTIZE_OPS = frozenset({"remat.dequantize_nf4"})
"""Operators that make a weight in the model's dtype from its quantized buffers (`remat.models.qlora`):
no FLOPs, their bytes at memory bandwidth."""
SCORE_OPS = frozenset({"aten.mm", "aten.bmm", "aten.baddbmm", "aten.matmul"})
SOFTMAX_OPS = frozenset({"aten._softmax", "aten.softmax", "aten._safe_softmax"})
FUSED_ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward", "aten._efficient_attention_forward",
})
_COLUMN = ("colwise", "packed_colwise", "local_colwise", "colwise_rep", "colwise_gather_output")
_ROW = ("rowwise", "packed_rowwise", "local_rowwise", "rowwise_rep")

ROLES = ("tensor", "whole", "vocab", "expert")
"""How a parameter is sharded: ``tensor`` over the tensor-parallel ranks (column- and
row-parallel weights, column-parallel biases), ``vocab`` over them too (embedding, head),
``whole`` on every rank (norms, routers, row-parallel biases), ``expert`` over the expert-parallel
(and expert tensor-parallel) ranks."""


@dataclass
class _Storage:
    nbytes: int
    segment: str
    split: bool
    expert: bool
    last_read: int = -1
    unsharded: bool = False
    """An attention kernel's mask bias (`remat.estimate.shares.Share.unsharded`)."""


@dataclass
class _Call:
    index: int
    name: str
    segment: str
    reads: tuple[int, ...]
    made: tuple[int, ...]
    flops: int
    split: bool
    expert: bool
    linear: bool
    outs: tuple[int, ...] = ()
    """Ids of every storage among its outputs, made or written in place."""
    params: tuple[str, ...] = ()
    """The parameters it reads."""
    dequant_bytes: int = 0
    """Bytes a weight's dequantization reads and writes (`DEQUANTIZE_OPS`)."""


@dataclass(kw_only=True, frozen=True)
class Classified:
    """What `classify` found in one forward."""

    flow: Flow
    """Shares of the part before the layers, each traced layer and the part after."""
    roles: Mapping[str, str]
    """Parameter name -> `ROLES` entry."""
    used_in: Mapping[str, frozenset[str]]
    """Parameter name -> segments whose ops read it (``pre``, ``layer:<i>``, ``post``)."""
    split_widths: Mapping[str, int]
    """Linear weight name -> the width tensor parallelism divides (a column-parallel output's,
    a row-parallel input's features)."""
    gradless: frozenset[str] = frozenset()
    """Parameters the step gives no gradient: frozen ones (``requires_grad=False``: RoFormer's
    sinusoidal position table), those no op reads (NeoMME's image patch embeddings, in a step over
    text) and those whose reading ops' outputs the loss is not computed from (BERT's pooler, in a
    masked LM's step): `_reaching_loss`."""
    unreached: frozenset[str] = frozenset()
    """Of ``gradless``, the trainable ones that ops read without the loss being computed from them
    (BERT's pooler in a masked LM's step; MRA's queries, keys and values, whose attention without
    its CUDA kernel returns zeros)."""


@dataclass
class _State:
    storages: dict[int, _Storage] = field(default_factory=dict)
    ids: dict[int, int] = field(default_factory=dict)
    calls: list[_Call] = field(default_factory=list)
    saved: dict[int, str] = field(default_factory=dict)
    inputs: dict[str, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    used_in: dict[str, set[str]] = field(default_factory=dict)
    widths: dict[str, int] = field(default_factory=dict)
    segment: str = PRE
    expert_depth: int = 0
    bwd_flops: dict[int, float] = field(default_factory=dict)
    """Call index -> FLOPs of its backward (`_backward_flops`)."""
    grad_calls: dict[int, int] = field(default_factory=dict)
    """Block index -> its calls with gradients enabled (a layer run at several depths: several)."""


class _Tracer(TorchDispatchMode):
    """Follows the dataflow of one forward (see the module docstring)."""

    def __init__(self, state: _State, params: dict[int, str], excluded: set[int], plan: Mapping[str, str]) -> None:
        super().__init__()
        self.state, self.params, self.excluded, self.plan = state, params, excluded, plan

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch._C._current_graph_task_id() == -1:
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        st = self.state
        name = str(getattr(func, "_overloadpacket", func))
        inputs = flat_tensors(args, kwargs)
        params = [self.params[k] for k in (storage_key(t) for t in inputs) if k in self.params]
        reads = tuple(i for i in (self._id(t) for t in inputs) if i is not None)
        if name == "aten._scaled_dot_product_efficient_attention" and len(args) > 3 and isinstance(args[3], torch.Tensor):
            bias = self._id(args[3])  # the mask as the fused kernel's bias: not split by heads nor sequence
            if bias is not None and bias in st.storages and not st.storages[bias].split:
                st.storages[bias].unsharded = True
        in_split = any(st.storages[i].split for i in reads)
        for p in params:
            st.used_in.setdefault(p, set()).add(st.segment)
        out_split = self._out_split(name, inputs, params, in_split, out)
        made = self._made(inputs, out, out_split)
        outs = tuple(i for i in (self._id(t) for t in flat_tensors((out,))) if i is not None)
        index = len(st.calls)
        for i in reads:
            if i in st.storages:
                st.storages[i].last_read = index
        st.calls.append(_Call(index=index, name=name, segment=st.segment, reads=reads, made=made,
                              flops=op_flops(func, args, kwargs, out), split=out_split or in_split,
                              expert=st.expert_depth > 0, linear=bool(params) and name in LINEAR_OPS,
                              outs=outs, params=tuple(params),
                              dequant_bytes=sum(t.numel() * t.element_size() for t in [*inputs, *flat_tensors((out,))])
                              if name in DEQUANTIZE_OPS else 0))

    def _out_split(self, name: str, inputs: list, params: list[str], in_split: bool, out: Any) -> bool:
        st = self.state
        if name == "aten.embedding":
            for p in params:
                st.roles.setdefault(p, "vocab")
            return False
        weight = next((self.params[storage_key(t)] for t in inputs if storage_key(t) in self.params and t.dim() >= 2), None)
        if name not in LINEAR_OPS or weight is None:
            return in_split
        activation = next(t for t in inputs if storage_key(t) not in self.params)
        role = self._linear_role(weight, in_split, (activation.shape[-1], flat_tensors((out,))[0].shape[-1]))
        for p in params:
            st.roles.setdefault(p, self._param_role(p, weight, role))
        if role == "column":
            st.widths[weight] = flat_tensors((out,))[0].shape[-1]
        elif role == "row":
            st.widths[weight] = activation.shape[-1]
        return role == "column" or (role == "whole" and in_split)

    def _linear_role(self, weight: str, in_split: bool, widths: tuple[int, int]) -> str:
        """``column``, ``row`` or ``whole``: the head is column-parallel over the vocabulary;
        else the plan's entry; a linear without one pairs as Megatron-LM's do: row-parallel on
        a split input, column-parallel on a whole one when it is at least half as wide out as
        in (an expanding projection: Qwen2-MoE's shared expert, which its plan leaves out),
        else whole (routers, gates, latent down-projections)."""
        if self.state.segment == POST:
            self.state.roles.setdefault(weight, "vocab")
            return "column"
        listed = plan_role(self.plan, weight) if self.plan else None
        if listed is not None:
            return listed
        if in_split:
            return "row"
        features_in, features_out = widths
        return "column" if 2 * features_out >= features_in else "whole"

    def _param_role(self, param: str, weight: str, role: str) -> str:
        """A linear's weight and bias: split with a column-parallel linear; a row-parallel one
        splits its weight and keeps its bias whole (it is added after the all-reduce)."""
        if self.state.expert_depth:
            return "expert"
        if role == "column" or (role == "row" and param == weight):
            return "tensor"
        return "whole"

    def _id(self, t: torch.Tensor) -> int | None:
        key = storage_key(t)
        return None if key is None else self.state.ids.get(key)

    def _made(self, inputs: list, out: Any, split: bool) -> tuple[int, ...]:
        """Ids of the new storages among the outputs (a view or an in-place op makes none; an
        in-place write of a split value marks its target split)."""
        st = self.state
        known = {storage_key(t) for t in inputs}
        made = []
        for t in flat_tensors((out,)):
            key = storage_key(t)
            if key is None or key in self.excluded:
                continue
            if key in known:
                if key in st.ids:
                    st.storages[st.ids[key]].split |= split
                continue
            ident = len(st.storages)
            st.ids[key] = ident
            st.storages[ident] = _Storage(nbytes=storage_nbytes(t), segment=st.segment, split=split,
                                          expert=st.expert_depth > 0)
            made.append(ident)
        return tuple(made)


def _one_vocabulary_table(state: _State, params: Mapping[str, torch.Tensor]) -> None:
    """Only the token embedding is vocabulary-parallel: other embedding tables before the layers
    (learned positions, token types) are whole on every rank, as in Megatron-LM."""
    tables = [n for n, r in state.roles.items() if r == "vocab" and POST not in state.used_in.get(n, ())]
    largest = max(tables, key=lambda n: params[n].shape[0], default=None)
    for name in tables:
        if name != largest:
            state.roles[name] = "whole"


def plan_role(plan: Mapping[str, str], weight: str) -> str | None:
    """``column`` or ``row`` for a weight by a Hugging Face tensor-parallel plan (patterns like
    ``layers.*.self_attn.q_proj`` over module or parameter names); None when it lists it not."""
    module = weight.rsplit(".", 1)[0]
    for pattern, style in plan.items():
        if any(fnmatch.fnmatchcase(name, f"*.{pattern}") for name in (weight, module)):
            if style in _COLUMN:
                return "column"
            if style in _ROW:
                return "row"
    return None


def is_experts_module(name: str, module: nn.Module) -> bool:
    """Routed experts: a module class named ``...Experts`` (Mixtral, Qwen2-MoE, DeepSeek in
    transformers 5), a module holding 3-D expert weights, or a list named ``experts``."""
    if "shared" in name.rsplit(".", 1)[-1].lower():
        return False
    own = list(module.parameters(recurse=False))
    return type(module).__name__.endswith("Experts") or any(p.dim() == 3 for p in own) or (
        name.rsplit(".", 1)[-1] == "experts" and isinstance(module, nn.ModuleList))


@contextlib.contextmanager
def _hooks(model: nn.Module, blocks: list[tuple[str, nn.Module]], state: _State,
           stack_ends: frozenset[int] = frozenset()) -> Iterator[None]:
    handles = []
    last = len(blocks) - 1

    def enter(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            state.segment = f"layer:{i}"
            if torch.is_grad_enabled():
                state.grad_calls[i] = state.grad_calls.get(i, 0) + 1
            hidden = next((t for t in tensors_in(args)), None) if args else kwargs.get("hidden_states")
            ids = {storage_key(t): t for t in tensors_in((args, kwargs))}
            own = storage_key(hidden) if isinstance(hidden, torch.Tensor) else None
            state.inputs[state.segment] = (state.ids.get(own), tuple(state.ids[k] for k in ids if k != own and k in state.ids))
        return hook

    def leave(i: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if i == last:
                state.segment = POST
            elif i in stack_ends:  # between an encoder's layers and its decoder's (`_flow`: the next stack's)
                state.segment = f"{GAP}{i + 1}"
        return hook

    def expert(delta: int):
        def hook(*_: Any) -> None:
            state.expert_depth += delta
        return hook

    for i, (_, block) in enumerate(blocks):
        handles += [block.register_forward_pre_hook(enter(i), with_kwargs=True), block.register_forward_hook(leave(i))]
    for name, module in model.named_modules():
        if is_experts_module(name, module):
            handles += [module.register_forward_pre_hook(expert(1)), module.register_forward_hook(expert(-1))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def classify(model: nn.Module, batch: Any, blocks: list[tuple[str, nn.Module]], *, loss_fn: Any = None,
             plan: Mapping[str, str] | None = None, stack_ends: frozenset[int] = frozenset()) -> Classified:
    """One forward and loss of ``model`` on ``batch`` (meta device), classified (module docstring).
    ``stack_ends``: blocks that end a stack of layers another stack follows (an encoder's last):
    what runs after such a block and before the next (the encoder's final norm, the decoder's
    embedding) is not a part of the layer it follows: it counts once, before the layers, with the
    encoder's output every decoder layer reads; what a stack's first layer makes for the later
    ones is held by that layer (`_flow`)."""
    state = _State()
    params = {storage_key(p): n for n, p in model.named_parameters()}
    excluded = {storage_key(t) for t in [*model.parameters(), *model.buffers(), *tensors_in(batch)]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in excluded and key in state.ids and state.ids[key] not in state.saved:
            state.saved[state.ids[key]] = state.segment
        return t

    with _hooks(model, blocks, state, stack_ends), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with _Tracer(state, params, excluded, plan or {}) as tracer:
            loss = compute_loss(call_model(model, batch), batch, loss_fn)
            loss_id = tracer._id(loss) if isinstance(loss, torch.Tensor) else None
    skipped = [name for i, (name, _) in enumerate(blocks) if f"layer:{i}" not in state.inputs]
    direct = [block for i, (_, block) in enumerate(blocks) if f"layer:{i}" not in state.inputs
              and not isinstance(block.__dict__.get("forward"), DirectCalls)]
    if direct:  # perhaps called as ``layer.forward(...)``, past the hooks: once more, such calls seen
        for block in direct:
            DirectCalls(block)
        return classify(model, batch, blocks, loss_fn=loss_fn, plan=plan, stack_ends=stack_ends)
    repeated = {name: state.grad_calls[i] for i, (name, _) in enumerate(blocks) if state.grad_calls.get(i, 0) > 1}
    if repeated:
        runs = ", ".join(f"{name} ({count} calls)" for name, count in repeated.items())
        raise ValueError(f"{type(model).__name__} runs {runs} several times per step with gradients, the same weights "
                         "at several depths or time steps (HRM's reasoning modules, a looped model, a recurrent cell); "
                         "the estimate prices each layer as one call. Measure it with `remat profile "
                         "path/to/file.py:build` at a size that runs here, where each call of such a layer is a block.")
    if skipped:
        raise ValueError(f"{type(model).__name__}'s traced step did not run its layer(s) {', '.join(skipped)} (skipped "
                         "as a LayerDrop rate or a branch of its own code decides), so no layer of the model can be "
                         "copied from them. Estimate it from a file.py:build that builds the whole model.")
    for name, module in model.named_modules():
        if is_experts_module(name, module):
            for p, _ in module.named_parameters(prefix=name):
                state.roles[p] = "expert"
    _one_vocabulary_table(state, dict(model.named_parameters()))
    roles = {n: state.roles.get(n, "whole") for n, _ in model.named_parameters()}
    loss_calls: set[int] | None = None  # the calls the loss is computed from (None: every call)
    if loss_id is not None:
        reached, live, loss_calls = _reaching_loss(state, loss_id)
        # what only ops the loss is not computed from save dies with their graph, as the forward drops
        # their outputs (BERT's pooler, in a masked LM's step): no backward holds it
        state.saved = {i: segment for i, segment in state.saved.items() if i in live}
    else:
        reached = set(roles)
    gradless = frozenset(n for n, p in model.named_parameters() if not p.requires_grad or n not in reached)
    named = dict(model.named_parameters())
    state.bwd_flops = _backward_flops(state, {n for n, p in named.items() if p.requires_grad},
                                      {n for n, p in named.items() if p.dim() >= 2}, loss_calls)
    unreached = frozenset(n for n, p in model.named_parameters()
                          if p.requires_grad and n not in reached and state.used_in.get(n))
    flow = _flow(state, len(blocks), frozenset({0} | {e + 1 for e in stack_ends}) if stack_ends else frozenset())
    return Classified(flow=flow, roles=roles, used_in={k: frozenset(v) for k, v in state.used_in.items()},
                      split_widths=dict(state.widths), gradless=gradless, unreached=unreached)


def _backward_flops(state: _State, trainable: set[str], matrices: set[str],
                    loss_calls: set[int] | None) -> dict[int, float]:
    """Call index -> the FLOPs its backward runs, as autograd runs it (and as
    ``torch.utils.flop_counter`` counts it). An op has a backward only when the loss is computed
    from its output (every op when there is no loss) and that output needs a gradient: it reads a
    trainable parameter or a tensor computed from one. A linear's backward is one product per
    gradient it gives: its input's, when the input needs one (not the batch's pixels, nor the
    output of frozen embeddings: the first layer of a LoRA model), and its weight's, when the
    weight is trained (not a frozen base weight under LoRA). A product of two tensors neither of
    which is a parameter runs one product per operand that needs a gradient: two for attention's
    scores, one for a weight dequantized from NF4 (`remat.models.qlora`). Other ops with FLOPs (a
    fused attention kernel) give their inputs' gradients: twice their forward, the convention of
    model-FLOPs counts (a fused kernel's backward replays its scores too: ``torch.utils.flop_counter``
    counts 2.5 times)."""
    grads: set[int] = set()
    reads_grad: dict[int, bool] = {}
    grads_at: dict[int, frozenset[int]] = {}
    for c in state.calls:  # forward: which ops' outputs need a gradient, and whether their inputs do
        reads = bool(grads.intersection(c.reads))
        if reads or trainable.intersection(c.params):
            if c.name in LINEAR_OPS and not c.linear:
                grads_at[c.index] = frozenset(grads.intersection(c.reads))
            grads.update(c.outs)
            reads_grad[c.index] = reads
    out: dict[int, float] = {}
    for c in state.calls:
        if (loss_calls is not None and c.index not in loss_calls) or c.index not in reads_grad or not c.flops:
            continue
        if c.linear:
            weight = any(p in trainable and p in matrices for p in c.params)
            out[c.index] = c.flops * (int(reads_grad[c.index]) + int(weight))
        elif c.name in LINEAR_OPS:  # a product of two tensors: one per operand that needs a gradient
            out[c.index] = c.flops * min(2, sum(1 for r in c.reads if r in grads_at[c.index]))
        else:
            out[c.index] = 2.0 * c.flops
    return out


def _reaching_loss(state: _State, loss: int) -> tuple[set[str], set[int], set[int]]:
    """(the parameters read by an op the loss is computed from, the storages such an op reads or
    outputs, the indices of those ops), through the ops' outputs back to their inputs (an op writing
    in place into a storage that is needed counts). An op that reads a tensor without passing its
    gradient (``zeros_like``, an index) counts too: a bound."""
    needed, reached, live, calls = {loss}, set(), {loss}, set()
    for call in reversed(state.calls):
        if needed.intersection(call.outs):
            needed.update(call.reads)
            reached.update(call.params)
            live.update(call.reads, call.outs)
            calls.add(call.index)
    return reached, live, calls


__all__ = ["Classified", "FUSED_ATTENTION_OPS", "ROLES", "classify", "is_experts_module", "plan_role"]


# -- from the call log to shares --------------------------------------------------------------

def _core(calls: list[_Call], state: _State) -> tuple[set[int], set[int]]:
    """(core call indices, core storage ids) of every attention core in the forward."""
    core_calls: set[int] = set()
    core_storages: set[int] = set()
    for c in calls:
        if c.name in FUSED_ATTENTION_OPS:
            core_calls.add(c.index)
            core_storages |= {s for s in c.made if s in state.saved and state.storages[s].last_read <= c.index}
        elif c.name in SOFTMAX_OPS:
            found = _explicit_core(calls, c, state)
            if found:
                core_calls |= found[0]
                core_storages |= found[1]
    return core_calls, core_storages


def _explicit_core(calls: list[_Call], softmax: _Call, state: _State) -> tuple[set[int], set[int]] | None:
    same = [c for c in calls if c.segment == softmax.segment and c.name in SCORE_OPS and not c.linear]
    score = next((c for c in reversed(same) if c.index < softmax.index), None)
    post = next((c for c in same if c.index > softmax.index), None)
    if score is None or post is None:
        return None
    derived, members = set(score.made), {score.index}
    for c in calls[score.index + 1 : post.index + 1]:
        if derived.intersection(c.reads):
            derived |= set(c.made)
            members.add(c.index)
    if softmax.index not in members:
        return None  # a softmax not over the scores (a MoE router's)
    kept = {s for s in derived if s in state.saved and state.storages[s].last_read <= post.index}
    return members, kept


def _bucket(core: bool, split: bool, expert: bool, unsharded: bool = False) -> str:
    if core:
        return "core"
    if unsharded and not expert:
        return "unsharded"
    return ("expert_" if expert else "") + ("split" if split else "whole")


def _add(totals: dict[str, dict[str, float]], segment: str, bucket: str, amount: float) -> None:
    totals.setdefault(segment, {}).setdefault(bucket, 0.0)
    totals[segment][bucket] += amount


def _held_by(made: str, saver: str, starts: frozenset[int]) -> str | None:
    """With several stacks (``starts``: their first layers), the layer that holds a storage made in
    segment ``made`` and saved first by ``saver`` ("": never saved) for the later layers of its
    stack: the stack's first layer, where it makes it (T5's position bias, which every layer of
    the stack adds); None: counted before the layers, held for the whole step (so is what runs
    between two stacks and the encoder's output: the measured step holds part of it to the end)."""
    if not starts or not made.startswith("layer:") or made == saver or saver.startswith(GAP):
        return None
    return made if int(made.removeprefix("layer:")) in starts else None


def _flow(state: _State, num_layers: int, starts: frozenset[int] = frozenset()) -> Flow:
    """Saved bytes, FLOPs and inputs per segment. A tensor made before a layer, or by an earlier
    layer, and passed to the layers (rotary tables, a mask) counts once, before the layers; so does
    what runs between two stacks. Several stacks (``starts``: the first layer of each, an
    encoder-decoder's): a tensor a stack's first layer makes for the later ones is held by that
    layer (`_held_by`), in its saved bytes where autograd saves it and in what its checkpoint
    keeps (``extra`` input bytes); one autograd never saves (T5's position bias) is kept only by
    the checkpoints: input bytes, not saved ones.

    What the part before the layers counts for the layers is told apart by the layer whose backward
    frees it (``released``: the first to save it or take it, the one after the code between two
    stacks; ``released_unsaved``: what no op saves, which nothing but a checkpoint holds past the
    forward), and so is what of it each layer's own measured working set counts too (it saves it
    first, or takes it first: ``first_saved_bytes``, ``first_entry_bytes``, ``first_alone_bytes``)."""
    core_calls, core_storages = _core(state.calls, state)
    saved: dict[str, dict[str, float]] = {}
    extra: dict[str, float] = {}
    released: dict[str, dict[str, float]] = {}  # of PRE's saved bytes, what each layer's backward frees, by bucket
    unsaved: dict[str, dict[str, float]] = {}  # of those, what no op saves
    first: dict[str, dict[str, float]] = {}  # per layer, what PRE counts of its measured working set, by where
    own_input = {seg: hidden for seg, (hidden, _) in state.inputs.items()}
    for ident, segment in state.saved.items():
        s = state.storages[ident]
        holder = _held_by(s.segment, segment, starts) if segment != POST else None
        bucket = _bucket(ident in core_storages, s.split, s.expert, s.unsharded)
        if holder is not None and own_input.get(segment) != ident:
            segment = holder
            extra[holder] = extra.get(holder, 0.0) + s.nbytes
        elif segment.startswith(GAP) or (segment.startswith("layer:") and s.segment != segment
                                         and own_input.get(segment) != ident):
            if segment.startswith("layer:"):
                _add(first, segment, "saved", s.nbytes)
            # freed by the backward of the first layer saving it, or of the one after the code between two stacks
            _add(released, segment.replace(GAP, "layer:"), bucket, s.nbytes)
            segment = PRE  # made before this layer and not its own input: shared by the layers
        _add(saved, segment, bucket, s.nbytes)
    order = sorted(state.inputs, key=lambda name: int(name.removeprefix("layer:")))
    takers: dict[int, list[str]] = {}
    for name in order:
        for ident in state.inputs[name][1]:
            if ident not in state.saved:
                takers.setdefault(ident, []).append(name)
    for ident, names in takers.items():
        nbytes = state.storages[ident].nbytes
        holder = _held_by(state.storages[ident].segment, "", starts)
        if holder is None:
            _add(saved, PRE, "whole", nbytes)
            _add(released, names[0], "whole", nbytes)
            _add(unsaved, names[0], "whole", nbytes)
            _add(first, names[0], "entry" if len(names) > 1 else "alone", nbytes)
        else:
            extra[holder] = extra.get(holder, 0.0) + nbytes
    flops: dict[str, dict[str, float]] = {}
    bwd_flops: dict[str, dict[str, float]] = {}
    moved: dict[str, float] = {}
    dequant: dict[str, float] = {}
    for c in state.calls:
        where = PRE if c.segment.startswith(GAP) else c.segment
        _add(flops, where, _bucket(c.index in core_calls, c.split, c.expert), c.flops)
        _add(bwd_flops, where, _bucket(c.index in core_calls, c.split, c.expert), state.bwd_flops.get(c.index, 0.0))
        dequant[where] = dequant.get(where, 0.0) + c.dequant_bytes
        if c.index in core_calls:
            moved[where] = moved.get(where, 0.0) + sum(state.storages[s].nbytes for s in c.made)

    def segment(name: str) -> Segment:
        hidden = own_input.get(name)
        return Segment(saved=Share(**saved.get(name, {})), flops=Share(**flops.get(name, {})),
                       bwd_flops=Share(**bwd_flops.get(name, {})), dequant_bytes=dequant.get(name, 0.0),
                       input_bytes=(state.storages[hidden].nbytes if hidden is not None else 0) + extra.get(name, 0.0),
                       kept_bytes=extra.get(name, 0.0), core_moved_bytes=moved.get(name, 0.0),
                       first_saved_bytes=first.get(name, {}).get("saved", 0.0),
                       first_entry_bytes=first.get(name, {}).get("entry", 0.0),
                       first_alone_bytes=first.get(name, {}).get("alone", 0.0),
                       released=Share(**released.get(name, {})), released_unsaved=Share(**unsaved.get(name, {})))

    return Flow(pre=segment(PRE), layers=tuple(segment(f"layer:{i}") for i in range(num_layers)), post=segment(POST))
