"""Model state: its byte counts, and an exact snapshot so `profile` leaves everything as it was."""

from __future__ import annotations

import contextlib
import copy
import gc
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from remat._batch import batch_tensors
from remat.checkpointing.attributes import put_back, snapshot
from remat.measure.storage import distinct_bytes
from remat.measure.tracker import optimizer_state_tensors


def param_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameter storages (tied weights count once)."""
    return distinct_bytes(model.parameters())


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the distinct buffer storages."""
    return distinct_bytes(model.buffers())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the distinct gradient storages now allocated."""
    return distinct_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's per-parameter state tensors (0-dim step counters excluded)."""
    return distinct_bytes(optimizer_state_tensors(optimizer))


class StateSnapshot:
    """Host copies of parameters, buffers, gradients and optimizer state; `restore` puts them
    back in place (same tensor objects, so references held by the caller stay valid). The
    copies live in host memory so that they take nothing from an accelerator being measured
    (on the CPU they are ordinary memory the tracker does not count)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        # the draws the caller would make next: Python's, NumPy's and the generators of the batch and
        # of the modules (a model masking with NumPy, SpecAugment, masks other frames after a profile)
        self.host_rng = (random.getstate(), np.random.get_state())
        self.generators = [(g, g.get_state()) for g in generators_in(batch) + model_generators(model)]
        with torch.no_grad():
            self.params = [_host_copy(p) for p in model.parameters()]
            # by module and name, None included: a buffer registered as None and filled by a forward (a
            # lazily made cache: PaLM's rotary table, block-recurrent's frequencies) appears in
            # ``model.buffers()`` after the step and shifts every one after it; restored by position,
            # each took its neighbour's values (BatchNorm's running statistics) and the cache a child's
            self.buffers = [(module, name, b, None if b is None else _host_copy(b))
                            for module in model.modules() for name, b in module._buffers.items()]
            self._buffer_names = {id(module): set(module._buffers) for module in model.modules()}
            self.grads = [None if p.grad is None else _host_copy(p.grad) for p in model.parameters()]
        # and the plain attributes beside them: a cache whose table is a buffer and whose filled length
        # an int (rotary_embedding_torch), put back to zeros that the int still said were filled, left
        # the model computing with an identity rotation after a profile
        self.attributes = snapshot(model.modules())
        self.inputs = BatchGrads(batch)
        self.optimizer_state: dict[str, Any] | None = (
            _host_state(optimizer.state_dict()) if optimizer is not None else None
        )
        # optimizers the step reaches without being handed to remat: stepped in the parameters'
        # post-accumulate-grad hooks (torchtune's optimizer in the backward, one per parameter)
        self.hook_optimizers = [(o, _host_state(o.state_dict())) for o in hooked_optimizers(model) if o is not optimizer]

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved, grad in zip(self.model.parameters(), self.params, self.grads):
                p.copy_(saved)
                p.grad = None if grad is None else grad.to(p.device)
            changed = []
            for module, name, b, saved in self.buffers:
                if module._buffers.get(name) is not b or b is not None and (b.shape != saved.shape or (
                        b.device.type != "meta" and not torch.equal(b.detach().to(saved.device), saved))):
                    changed.append(module)
                if b is not None:
                    if b.shape != saved.shape:  # resized in place by a forward (a QAT per-channel observer's, empty at first)
                        b.resize_(saved.shape)
                    b.copy_(saved)
                module._buffers[name] = b  # the object it held (None for a cache not made yet)
            for module in self.model.modules():  # buffers a forward registered anew
                for name in set(module._buffers) - self._buffer_names.get(id(module), set(module._buffers)):
                    del module._buffers[name]
        put_back(self.attributes, changed)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self.optimizer_state)
        for optimizer, state in self.hook_optimizers:
            optimizer.load_state_dict(state)
        self.inputs.restore()
        random.setstate(self.host_rng[0])
        np.random.set_state(self.host_rng[1])
        for g, state in self.generators:
            g.set_state(state)


def hooked_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers of the model's parameters where a parameter has post-accumulate-grad hooks
    (an optimizer stepped in the backward): every live ``torch.optim.Optimizer`` holding one of
    its parameters. None without such hooks (no search of the heap)."""
    params = {id(p) for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None)}
    if not params:
        return []
    return [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)  # type(): no __class__ lookups
            and any(id(p) in params for group in o.param_groups for p in group["params"])]


def generators_in(value: Any, out: list[torch.Generator] | None = None) -> list[torch.Generator]:
    """The ``torch.Generator`` objects in ``value`` (a batch: nested mappings, tuples and lists),
    each once."""
    out = [] if out is None else out
    if isinstance(value, torch.Generator):
        if all(g is not value for g in out):
            out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            generators_in(v, out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            generators_in(v, out)
    return out


def model_generators(model: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the model's modules hold as attributes (a block drawing
    its dropout masks from its own)."""
    out: list[torch.Generator] = []
    for module in model.modules():
        generators_in(list(vars(module).values()), out)
    return out


class BatchGrads:
    """The ``.grad`` of the batch's leaf tensors that require a gradient (``inputs_embeds``, an
    adversarial input), put back by `restore`: the steps remat runs would otherwise leave their
    input gradients summed in the caller's tensors."""

    def __init__(self, batch: Any) -> None:
        leaves = [t for t in batch_tensors(batch) if t.requires_grad and t.is_leaf] if batch is not None else []
        self.saved = [(t, None if t.grad is None else t.grad.detach().clone()) for t in leaves]

    def restore(self) -> None:
        for t, grad in self.saved:
            t.grad = grad

    def __enter__(self) -> BatchGrads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        return t.detach().clone()
    try:
        return t.detach().to("cpu", copy=True)
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass whose .to takes no copy= (QLoRA's
        return t.detach().clone()  # NF4 weights, torchao): a copy where it lives


def _host_state(state_dict: Any) -> Any:
    """A deep copy of an optimizer state dict with its tensors on the host (loading it back
    casts them to each parameter's device, as `torch.optim.Optimizer.load_state_dict` does).
    Any nesting of dicts, lists and tuples is copied so: an optimizer that wraps others (one
    for sparse gradients, one for dense) may lay its state dict out as it likes."""
    if isinstance(state_dict, torch.Tensor):
        return _host_copy(state_dict)
    if isinstance(state_dict, dict):
        return {k: _host_state(v) for k, v in state_dict.items()}
    if type(state_dict) in (list, tuple):
        return type(state_dict)(_host_state(v) for v in state_dict)
    return copy.deepcopy(state_dict)


@contextlib.contextmanager
def host_rng_restored(generators: list[torch.Generator]) -> Iterator[None]:
    """Python's `random`, NumPy's global generator and ``generators`` (the batch's) as they were
    before (torch's own are forked by `torch.random.fork_rng`)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    states = [g.get_state() for g in generators]
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        for g, state in zip(generators, states):
            g.set_state(state)
