"""How a model calls its blocks: what a block hands on, and when two calls take the same arguments.

A block's *chained input* is its first positional argument (the hidden states a Hugging Face
layer receives positionally); what it hands on is its output, or the output's first element
(Hugging Face layers return a tensor or a tuple that starts with the hidden states). Block
``i+1`` *follows* block ``i`` when its chained input is exactly (by identity) what block ``i``
handed on and every other argument is the same as block ``i``'s: then a checkpointed segment can
run block ``i+1`` from block ``i``'s output with block ``i``'s arguments and reproduce the call
(`remat.apply.runtime` relies on the same rule, `same_arguments`, when it runs segments).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["first_output", "chained_input", "same_value", "same_tensor", "same_arguments", "follows"]


def first_output(output: Any) -> torch.Tensor | None:
    """What a block hands on to the next one: its output tensor, or the first element of a
    tuple/list output when that is a tensor; None otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def chained_input(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> torch.Tensor | None:
    """The block's chained input: its first positional argument when that is a tensor; for a
    block called with keyword arguments only, its first tensor keyword argument (what the runtime
    passes through the checkpoint, `remat.checkpointing.region.first_argument`)."""
    if args:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    return next((v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)), None)


def same_value(a: Any, b: Any) -> bool:
    """Tensors are the same when they are the same object or alias each other whole
    (`same_tensor`); tuples, lists and dicts when their elements are the same; anything else when
    it is the same object or of the same type and equal (an ``==`` that is not a plain bool, or
    raises, counts as different)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return same_tensor(a, b)
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping) and type(a) is type(b):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a bool are simply not "the same"
        return False


def same_tensor(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or both are plain tensors over the same memory with the same view of it
    (storage, offset, shape, strides, dtype) and the same ``requires_grad``: an alias an identity
    autograd function made. FSDP2 hands each unit's forward its tensor arguments through one
    (``RegisterPostBackwardFunction``, for its post-backward hook), so the encoder's output that
    a T5 decoder hands every layer reached the second layer of a unit as another object than
    the first layer's (a segment of two decoder layers refused to run). A detached alias does not
    count (it would stop the gradient the other one carries)."""
    if a is b:
        return True
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor:  # noqa: E721 - subclasses compare by identity
        return False
    if a.layout != torch.strided or b.layout != torch.strided or a.device.type == "meta":
        return False  # no storage to compare (sparse), or none at all (meta)
    return (a.requires_grad == b.requires_grad and a.device == b.device and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def same_arguments(extra_a: tuple[Any, ...], kwargs_a: Mapping[str, Any], extra_b: tuple[Any, ...],
                   kwargs_b: Mapping[str, Any]) -> bool:
    """Two calls' arguments after the chained input (positional, then keyword) are the same."""
    if len(extra_a) != len(extra_b) or set(kwargs_a) != set(kwargs_b):
        return False
    return all(map(same_value, extra_a, extra_b)) and all(same_value(kwargs_a[k], kwargs_b[k]) for k in kwargs_a)


def follows(previous_call: tuple[tuple[Any, ...], Mapping[str, Any], Any],
            call: tuple[tuple[Any, ...], Mapping[str, Any]]) -> bool:
    """Block ``call`` follows ``previous_call`` (``(args, kwargs, output)``): its chained input is
    what the previous call handed on and its other arguments are the previous call's."""
    prev_args, prev_kwargs, prev_output = previous_call
    args, kwargs = call
    handed = first_output(prev_output)
    if handed is None or chained_input(args) is not handed:
        return False
    return same_arguments(prev_args[1:], prev_kwargs, args[1:], kwargs)
