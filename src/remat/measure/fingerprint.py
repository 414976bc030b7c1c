"""The fingerprint a plan must match: model structure, batch shapes, device, dtype, torch."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat._batch import batch_shapes, model_device
from remat.measure.types import Fingerprint, block_names_hash


def model_hash(model: nn.Module) -> str:
    """SHA-256 (16 hex digits) of qualified module names and classes, and of every parameter's
    and buffer's name, shape and dtype. Weights' values do not enter: training keeps the hash.
    Nor do a traced graph's constants (``torch.fx``'s ``_tensor_constant0``...): a copy of a
    ``GraphModule`` registers as buffers the constants its original held as plain attributes
    (e3nn's generated tensor products), and a plan was refused on a copy of the model it was made
    for."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"m {name} {type(module).__qualname__}\n".encode())
    for kind, tensors in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in tensors:
            if kind == "b" and _GRAPH_CONSTANT.fullmatch(name.rpartition(".")[2]):
                continue
            digest.update(f"{kind} {name} {tuple(t.shape)} {t.dtype}\n".encode())
    return digest.hexdigest()[:16]


_GRAPH_CONSTANT = re.compile(r"_tensor_constant\d+")
"""How ``torch.fx`` names the tensor constants of a traced graph."""


def model_dtype(model: nn.Module) -> str:
    """dtype of the first floating-point parameter (``"float32"`` for a model without one)."""
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def fingerprint(model: nn.Module, batch: Any, block_names: Sequence[str] | None = None) -> Fingerprint:
    """The fingerprint of ``model`` run on ``batch`` (with ``block_names``: of those blocks too)."""
    return Fingerprint(
        model_hash=model_hash(model), batch_shapes=batch_shapes(batch),
        device=model_device(model).type, dtype=model_dtype(model), torch_version=torch.__version__,
        block_names_hash="" if block_names is None else block_names_hash(block_names),
    )
