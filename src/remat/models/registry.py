"""The registry of built-in models: name -> sizes dataclass, model builder, batch maker, loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.models import convnet, gpt, hf, mlp, unet


@dataclass(kw_only=True, frozen=True)
class BuiltModel:
    """A model ready to train: its batch, loss and optimizer."""

    model: nn.Module
    """The module (random weights, on the CPU unless `remat.models.load_target` moved it, in training
    mode)."""
    batch: Any
    """The batch, by the calling convention of `remat._batch`."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    """``loss_fn(output, batch)``, or None when the model returns its loss."""
    optimizer: torch.optim.Optimizer | None
    """AdamW on the model's parameters by default."""
    name: str
    """The name the model was built from."""


@dataclass(kw_only=True, frozen=True)
class _Entry:
    config_cls: type
    make_model: Callable[[Any], nn.Module]
    make_batch: Callable[[Any, torch.Generator], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None


def _hf_entry(family: str) -> _Entry:
    return _Entry(
        config_cls=hf.HFConfig,
        make_model=lambda sizes: hf.build_hf_model(family, sizes),
        make_batch=hf.make_batch,
    )


_REGISTRY: dict[str, _Entry] = {
    "gpt": _Entry(config_cls=gpt.GPTConfig, make_model=gpt.GPT, make_batch=gpt.make_batch),
    "mlp": _Entry(
        config_cls=mlp.MLPConfig, make_model=mlp.DeepMLP, make_batch=mlp.make_batch,
        loss_fn=mlp.reconstruction_loss,
    ),
    "convnet": _Entry(config_cls=convnet.ConvNetConfig, make_model=convnet.ConvNet, make_batch=convnet.make_batch),
    "unet": _Entry(config_cls=unet.UNetConfig, make_model=unet.UNet, make_batch=unet.make_batch),
}
if hf.transformers_available():
    _REGISTRY.update({f"hf:{family}": _hf_entry(family) for family in hf.HF_FAMILIES})

MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def model_sizes(name: str) -> dict[str, Any]:
    """The size keywords of model ``name`` and their defaults."""
    entry = _entry(name)
    return {f.name: f.default for f in dataclasses.fields(entry.config_cls)}


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        hint = ""
        if name.startswith("hf:") and not hf.transformers_available():
            hint = " (hf:* models need `pip install remat[hf]`)"
        elif name.startswith("hf:"):
            hint = (" (remat builds Hugging Face models from a config with random weights and never downloads one: "
                    "name hf:gpt2, hf:llama or hf:t5, or build yours in a file and pass path/to/file.py:build)")
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}{hint}.")
    return _REGISTRY[name]


def _config(name: str, entry: _Entry, sizes: dict[str, Any]) -> Any:
    allowed = [f.name for f in dataclasses.fields(entry.config_cls)]
    unknown = sorted(set(sizes) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown size(s) {unknown} for model {name!r}; allowed: {', '.join(allowed)}."
        )
    return entry.config_cls(**sizes)


def build(name: str, *, seed: int = 0, optimizer: str = "adamw", lr: float = 1e-3, **sizes: Any) -> BuiltModel:
    """Build model ``name`` with deterministic weights and batch from ``seed``.

    ``optimizer`` is ``"adamw"`` (default), ``"adam"``, ``"sgd"`` (momentum 0.9) or ``"none"``.
    """
    entry = _entry(name)
    config = _config(name, entry, sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = entry.make_model(config)
    model.train()
    batch = entry.make_batch(config, torch.Generator().manual_seed(seed))
    return BuiltModel(
        model=model, batch=batch, loss_fn=entry.loss_fn,
        optimizer=make_optimizer(optimizer, model, lr=lr), name=name,
    )


_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], float], torch.optim.Optimizer]] = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}


def make_optimizer(kind: str, model: nn.Module, *, lr: float = 1e-3) -> torch.optim.Optimizer | None:
    """An optimizer of ``kind`` (adamw, adam, sgd, none) on the model's parameters."""
    if kind == "none":
        return None
    if kind not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; allowed: {', '.join(_OPTIMIZERS)}, none.")
    return _OPTIMIZERS[kind](list(model.parameters()), lr)
