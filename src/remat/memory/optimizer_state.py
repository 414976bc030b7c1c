"""Optimizer state bytes: a table per optimizer, and an exact count from a real instance.

Each layout gives the device bytes of the state one parameter tensor of a given shape gets,
with the state kept in ``state_dtype_bytes`` per element (4 for fp32 state, as in mixed
precision; 2 for pure bf16 training). Scalar step counters are not counted: PyTorch keeps
``state["step"]`` as a host tensor unless ``capturable``/``fused`` is set, and bitsandbytes
keeps it as a Python int.

Layouts:
- ``sgd``: no state.
- ``sgd-momentum``: one momentum buffer per element.
- ``adam`` / ``adamw``: first and second moment per element.
- ``adafactor``: factored second moment (Shazeer & Stern 2018): for a tensor of 2 or more
  dimensions one row vector (``shape[:-1]``) and one column vector (``shape[:-2] + shape[-1:]``);
  a full second moment for vectors. No first moment (``beta1=None``, as ``torch.optim.Adafactor``
  and the Hugging Face default).
- ``adam8bit``: bitsandbytes ``Adam8bit`` with block-wise quantization
  (``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.init_state``): two ``uint8`` state
  tensors (1 byte per element each) plus one fp32 ``absmax`` per block of ``blocksize``
  elements for each of them (blocksize 256 since bitsandbytes 0.44, pull request #1365; 2048 before);
  tensors with fewer than ``min_8bit_size`` = 4096 elements keep two fp32 states. The two
  256-entry fp32 quantization maps are shared by all tensors (2048 bytes once).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

BNB_BLOCKSIZE = 256
"""bitsandbytes block size for block-wise 8-bit optimizer state (0.44 and later; 2048 before)."""
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes ``min_8bit_size``: smaller tensors keep fp32 optimizer state."""
BNB_QMAP_BYTES = 2 * 256 * 4
"""The signed and unsigned dynamic quantization maps, 256 fp32 values each, shared."""

Shape = Sequence[int]


@dataclass(kw_only=True, frozen=True)
class OptimizerLayout:
    """How much state an optimizer keeps per parameter tensor."""

    name: str
    """Canonical name, e.g. ``"adamw"``."""
    description: str
    """One line for tables and diagnoses."""
    tensor_bytes: Callable[[Shape, int], int]
    """Bytes of state for a tensor of ``shape`` with ``state_dtype_bytes`` per state element."""
    shared_bytes: int = 0
    """Bytes kept once per optimizer (bitsandbytes quantization maps)."""


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _adafactor(shape: Shape, elem: int) -> int:
    if len(shape) < 2:
        return _numel(shape) * elem
    rows = _numel(shape[:-1])
    cols = _numel(shape[:-2]) * shape[-1]
    return (rows + cols) * elem


def adam8bit_tensor_bytes(shape: Shape, elem: int = 4, *, blocksize: int = BNB_BLOCKSIZE) -> int:
    """bitsandbytes Adam8bit state of one tensor (``elem`` applies to small fp32-state tensors)."""
    n = _numel(shape)
    if n < BNB_MIN_8BIT_SIZE:
        return 2 * n * 4
    blocks = -(-n // blocksize)
    return 2 * n + 2 * blocks * 4


LAYOUTS: dict[str, OptimizerLayout] = {
    layout.name: layout
    for layout in (
        OptimizerLayout(name="none", description="no optimizer", tensor_bytes=lambda s, e: 0),
        OptimizerLayout(name="sgd", description="SGD without momentum: no state", tensor_bytes=lambda s, e: 0),
        OptimizerLayout(
            name="sgd-momentum", description="SGD with momentum: 1 buffer per parameter",
            tensor_bytes=lambda s, e: _numel(s) * e,
        ),
        OptimizerLayout(
            name="adam", description="Adam: 2 moments per parameter",
            tensor_bytes=lambda s, e: 2 * _numel(s) * e,
        ),
        OptimizerLayout(
            name="adamw", description="AdamW: 2 moments per parameter",
            tensor_bytes=lambda s, e: 2 * _numel(s) * e,
        ),
        OptimizerLayout(
            name="adafactor", description="Adafactor: factored second moment (rows + columns)",
            tensor_bytes=_adafactor,
        ),
        OptimizerLayout(
            name="adam8bit", description="8-bit Adam (bitsandbytes, block-wise): 2 bytes per parameter + absmax",
            tensor_bytes=adam8bit_tensor_bytes, shared_bytes=BNB_QMAP_BYTES,
        ),
    )
}

_ALIASES = {"momentum": "sgd-momentum", "sgd_momentum": "sgd-momentum", "adam-8bit": "adam8bit",
            "adamw8bit": "adam8bit", "adam_8bit": "adam8bit", "bnb-adam8bit": "adam8bit"}


def optimizer_layout(name: str) -> OptimizerLayout:
    """The layout for an optimizer name (case-insensitive; a few aliases accepted)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in LAYOUTS:
        raise ValueError(
            f"unknown optimizer {name!r}; allowed: {', '.join(sorted(LAYOUTS))}. "
            "Pass one of these names, or measure a real optimizer with optimizer_state_bytes_of()."
        )
    return LAYOUTS[key]


def optimizer_state_bytes(name: str, shapes: Iterable[Shape], *, state_dtype_bytes: int = 4) -> int:
    """Bytes of optimizer state for parameter tensors of ``shapes`` (the table, not a measurement)."""
    layout = optimizer_layout(name)
    total = sum(layout.tensor_bytes(tuple(s), state_dtype_bytes) for s in shapes)
    return total + (layout.shared_bytes if total else 0)


_CLASS_NAMES = {"adam": "adam", "adamw": "adamw", "adafactor": "adafactor", "adam8bit": "adam8bit",
                "adamw8bit": "adam8bit", "pagedadam8bit": "adam8bit", "pagedadamw8bit": "adam8bit"}


def optimizer_name_of(optimizer: torch.optim.Optimizer) -> str:
    """The table's name for a real optimizer instance (SGD: with or without momentum)."""
    cls = type(optimizer).__name__
    if cls == "SGD":
        return "sgd-momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    if cls.lower() not in _CLASS_NAMES:
        raise ValueError(
            f"optimizer {cls} has no entry in the state table ({', '.join(sorted(LAYOUTS))}); pass the closest "
            "name explicitly, or measure its state after one step with optimizer_state_bytes_of()."
        )
    return _CLASS_NAMES[cls.lower()]


def optimizer_state_bytes_of(optimizer: torch.optim.Optimizer, *, include_host: bool = False) -> int:
    """Exact bytes of a real optimizer's state tensors, each storage counted once.

    Only tensors on the device of their parameter count, unless ``include_host``: PyTorch keeps
    scalar ``step`` counters on the host for non-capturable optimizers, so a CPU-resident 0-dim
    ``step`` is host bookkeeping and is skipped too (the table's convention).
    """
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step" and value.dim() == 0 and value.device.type == "cpu" and not include_host:
                continue
            if value.device != param.device and not include_host:
                continue
            storage = value.untyped_storage()
            key = (value.device, storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
