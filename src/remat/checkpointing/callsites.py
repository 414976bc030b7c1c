"""Each call of a layer that runs several times per step, as a block of its own.

A layer whose weights serve several depths (ALBERT's layer group, a Universal Transformer's one
layer, a recurrent cell stepped over time) runs several times per forward, and each call saves its
own activations: the calls, not the layer, are what a plan keeps or recomputes. remat names the
``i``-th call of layer ``name`` in a step ``name@i`` and gives it a *call site*: a module object of
its own, which the layer hands its ``i``-th call to. Every hook, probe and runtime of remat then
sees one module called once, as for any other block.

A call site shares everything with its layer: it reads and writes the layer's attributes,
parameters, buffers and children (`_CallSite.__getattr__`, ``__setattr__``), so ``train()``, a
weight update or a state set in the forward reach both. It holds only its own hooks and how it is
called (`_OWN`: the ``forward`` a runtime installs on it). It is never registered as a submodule,
so the model's parameters, ``state_dict`` keys and module tree stay as they are.

The layer hands its calls on through `Sites`, its ``forward`` instance attribute while sites are
installed, counting them from the model's forward (a pre-hook on the model resets the count): its
``i``-th call goes to site ``i``; a call beyond the sites planned (a longer loop in evaluation) runs
the layer's own forward. `install` puts them in place, `uninstall` restores the layer.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["SEPARATOR", "split_site", "site_name", "is_site", "layer_of", "layers_of", "Sites", "install", "uninstall", "block_modules",
           "sites_in", "DirectCalls"]

SEPARATOR = "@"
"""Between a layer's qualified name and the number of its call: ``encoder.layer@3``."""

_SITE = re.compile(r"^(?P<name>.+)@(?P<index>0|[1-9][0-9]*)$")


def split_site(name: str) -> tuple[str, int | None]:
    """``(layer name, call index)`` of a block name; the index is None for a plain module name."""
    match = _SITE.match(name)
    return (name, None) if match is None else (match["name"], int(match["index"]))


def site_name(name: str, index: int) -> str:
    return f"{name}{SEPARATOR}{index}"


def is_site(module: nn.Module) -> bool:
    return isinstance(module, _CallSite)


def layer_of(module: nn.Module) -> nn.Module:
    """The layer whose call ``module`` is, or ``module`` itself: what holds the attributes."""
    return module.__dict__.get("_site_of", module)


def layers_of(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """`layer_of` each of ``modules``, each layer once, in order (the calls of one layer: the layer)."""
    return list({id(layer): layer for layer in map(layer_of, modules)}.values())


_OWN = frozenset({"forward", "_call_impl", "_compiled_call_impl"})
"""Attributes set on a call site that stay its own: how it is called (a runtime's ``forward``,
the compiled profile's ``_call_impl`` that hides a block from dynamo); any other goes to the layer."""


class _CallSite(nn.Module):
    """Mixin of a call site's class (made per layer class by `_site_class`): attributes come
    from, and go to, the layer (``_site_of``), but hooks and ``forward``, which stay its own."""

    def __getattr__(self, name: str) -> Any:
        try:
            layer = self.__dict__["_site_of"]
        except KeyError:  # being copied: no layer yet
            raise AttributeError(name) from None
        return getattr(layer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ or name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.__dict__["_site_of"], name, value)

    def extra_repr(self) -> str:  # the layer's (torch's RNN cells read theirs from ``self.__dict__``)
        return self.__dict__["_site_of"].extra_repr()

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__:
            object.__delattr__(self, name)
        else:
            delattr(self.__dict__["_site_of"], name)


@functools.lru_cache(maxsize=None)
def _site_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of the layer's class (``isinstance``, ``type(site).forward`` and the class name
    as the layer's) with `_CallSite`'s attribute rules first."""
    return type(cls.__name__, (_CallSite, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _make_site(layer: nn.Module, index: int, forward: Any) -> nn.Module:
    site = object.__new__(_site_class(type(layer)))
    own = {key: OrderedDict() for key, value in layer.__dict__.items() if "hooks" in key and isinstance(value, dict)}
    own.update(_site_of=layer, _site_index=index)
    if forward is not None:  # the layer's own instance forward (an accelerate hook's), bound to the layer
        own["forward"] = forward
    object.__setattr__(site, "__dict__", own)
    return site


class Sites:
    """The ``forward`` instance attribute of a layer whose calls are blocks: hands call ``i`` of
    the model's forward to site ``i``. A plain object (not a closure), so ``copy.deepcopy`` of the
    model copies the sites with the layer."""

    def __init__(self, layer: nn.Module, count: int, saved_forward: Any) -> None:
        self.layer = layer
        self.saved_forward = saved_forward
        self.sites = [_make_site(layer, i, saved_forward) for i in range(count)]
        self.calls = 0
        self.reset_handle: Any = None
        self.planned: set[int] | None = None
        """The calls a plan applied has blocks for (None while profiling): a call with gradients
        that is not one of them runs without the plan, and a warning says so once."""
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        index = self.calls
        self.calls += 1
        if self.planned is not None and index not in self.planned and not self.warned and torch.is_grad_enabled():
            self.warned = True
            warnings.warn(
                f"remat: call {index} of {type(self.layer).__name__} in this forward runs with gradients, but the plan "
                f"has blocks for its calls {_spans(self.planned)} only (the step it was profiled on called it "
                "otherwise: a loop of another length, a varying number of calls without gradients before it): that "
                "call runs without the plan, its activations all kept. Profile and plan the step as it runs now.",
                UserWarning, stacklevel=2)
        if index < len(self.sites):
            return self.sites[index](*args, **kwargs)
        own = self.saved_forward if self.saved_forward is not None else functools.partial(type(self.layer).forward,
                                                                                          self.layer)
        return own(*args, **kwargs)

    def reset(self, *_: Any, **__: Any) -> None:
        self.calls = 0


def _spans(indices: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def sites_in(layer: nn.Module) -> Sites | None:
    found = layer.__dict__.get("forward")
    return found if isinstance(found, Sites) else None


def install(model: nn.Module, counts: dict[str, int]) -> dict[str, Sites]:
    """Sites for layer ``name``'s ``counts[name]`` calls (more when the layer has more installed
    already), counted from each forward of ``model``; what was installed, by layer name."""
    installed: dict[str, Sites] = {}
    try:
        for name, count in counts.items():
            layer = model.get_submodule(name)
            found = sites_in(layer)
            if found is not None:
                if count > len(found.sites):
                    found.sites += [_make_site(layer, i, found.saved_forward) for i in range(len(found.sites), count)]
                continue
            sites = Sites(layer, count, layer.__dict__.get("forward"))
            layer.forward = sites
            sites.reset_handle = model.register_forward_pre_hook(sites.reset)
            installed[name] = sites
    except Exception:
        uninstall(installed.values())
        raise
    return installed


def uninstall(installed: Sequence[Sites] | Any) -> None:
    """Give each layer of ``installed`` its own ``forward`` back."""
    for sites in installed:
        layer = sites.layer
        if layer.__dict__.get("forward") is sites:
            del layer.__dict__["forward"]
            if sites.saved_forward is not None:
                layer.forward = sites.saved_forward
        if sites.reset_handle is not None:
            sites.reset_handle.remove()


def block_modules(model: nn.Module, names: Sequence[str]) -> tuple[list[nn.Module], dict[str, Sites]]:
    """The modules of block ``names`` in ``model`` (a call site for ``layer@i``, its layer's sites
    installed where they are not: the second value, for `uninstall`). AttributeError names a
    module the model does not have."""
    calls: dict[str, set[int]] = {}
    for name in names:
        layer, index = split_site(name)
        if index is not None:
            calls.setdefault(layer, set()).add(index)
    installed = install(model, {layer: max(indices) + 1 for layer, indices in calls.items()}) if calls else {}
    for layer, indices in calls.items():
        sites = sites_in(model.get_submodule(layer))
        sites.planned = (sites.planned or set()) | indices
    try:
        modules = []
        for name in names:
            layer, index = split_site(name)
            modules.append(model.get_submodule(name) if index is None else sites_in(model.get_submodule(layer)).sites[index])
    except Exception:
        uninstall(installed.values())
        raise
    return modules, installed


class DirectCalls:
    """A module's ``forward`` instance attribute that sends a call made past the module's hooks
    (the parent calls ``module.forward(...)``, as SqueezeBERT's encoder does) through
    ``module(...)``, hooks and all; a call through ``module(...)`` runs the module's own forward
    (the pre-hook it adds first says it came that way). For a model remat only traces (the
    estimate's meta-device copies); a profiled or applied model takes such calls through call sites."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module.forward
        self.entered = 0
        self.handles = (module.register_forward_pre_hook(self._enter, prepend=True),
                        module.register_forward_hook(self._leave, always_call=True))
        module.forward = self

    def _enter(self, *_: Any) -> None:
        self.entered += 1

    def _leave(self, *_: Any) -> None:
        self.entered -= 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.entered:
            return self.inner(*args, **kwargs)
        return self.module(*args, **kwargs)

