"""Build the target of a command: a built-in model name or ``path/to/file.py:function``.

``function()`` returns ``model, batch`` and optionally ``loss_fn`` and ``optimizer``. The
plan, run, demo and estimate commands share this loader with ``remat profile``. A file target is
imported: its code runs with the caller's permissions. Whatever it raises while being imported or
called (a syntax error, an exception, ``sys.exit``) becomes a `TargetCodeError` naming the file,
the line and the exception, chained to it (``remat --debug`` shows the original traceback).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_map

from remat.models.registry import MODEL_NAMES, BuiltModel, build, model_sizes

class TargetCodeError(RuntimeError):
    """The code of a ``file.py:function`` target failed while being imported or called."""


SIZE_OPTIONS: dict[str, tuple[str, ...]] = {
    "layers": ("num_layers", "depth", "num_blocks"),  # unet: depth (levels of the down path)
    "d_model": ("d_model", "width", "channels"),
    "heads": ("num_heads",),
    "seq": ("seq_len", "image_size"),
    "batch": ("batch_size",),
    "vocab": ("vocab_size",),
    "dropout": ("dropout",),
    "attention": ("attention",),
}
"""Command-line size options -> the size keyword each built-in model calls them (``--layers``
is ``num_layers`` for gpt, ``depth`` for mlp, ``num_blocks`` for convnet...)."""


def sizes_from_options(name: str, **options: Any) -> dict[str, Any]:
    """Translate command-line size options (`SIZE_OPTIONS` keys; None = not given) for model ``name``."""
    given = {k: v for k, v in options.items() if v is not None}
    if given and is_file_target(name):
        raise ValueError(
            f"size options {sorted(given)} apply to built-in models only, not to {name!r}; "
            "set the sizes inside the build function instead."
        )
    known = model_sizes(name) if given else {}
    sizes = {}
    for option, value in given.items():
        keys = [k for k in SIZE_OPTIONS.get(option, ()) if k in known]
        if not keys:
            usable = sorted(o for o, ks in SIZE_OPTIONS.items() if any(k in known for k in ks))
            raise ValueError(
                f"option --{option.replace('_', '-')} does not apply to model {name!r}; "
                f"its size options: {', '.join('--' + o.replace('_', '-') for o in usable)}."
            )
        sizes[keys[0]] = value
    return sizes


def is_file_target(spec: str) -> bool:
    """True for ``path/to/file.py:function`` (as opposed to a built-in name such as ``hf:gpt2``)."""
    return ":" in spec and not spec.startswith("hf:")


def load_target(spec: str, *, seed: int = 0, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, **sizes: Any) -> BuiltModel:
    """A built-in model (``"gpt"``, ``"hf:llama"``...) or the result of ``file.py:function()``.

    Sizes whose value is None are ignored, so a CLI can pass every option through; ``seed``
    seeds a built-in model (a build function seeds itself). ``device``: move the model and the
    batch's tensors there (`resolve_device`); built-in models are built on the CPU first, so a
    seed gives the same weights on every device. None leaves them where they were built.
    ``dtype``: a floating dtype for the parameters, floating buffers and floating batch tensors
    (``torch.bfloat16``: pure 16-bit training); integer tensors (token ids, masks) keep theirs.
    """
    sizes = {k: v for k, v in sizes.items() if v is not None}
    target = None if device is None else resolve_device(device)  # a bad device fails before building
    _check_dtype(dtype)
    if is_file_target(spec):
        if sizes:
            raise ValueError(
                f"size options {sorted(sizes)} apply to built-in models only, not to {spec!r}; "
                "set the sizes inside the build function instead."
            )
        built = load_file_target(spec)
    else:
        built = build(spec, seed=seed, **sizes)
    return built if target is None and dtype is None else move_to(built, target, dtype)


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a `torch.device` this machine has: ``cpu``, ``cuda``, ``cuda:N`` (or another
    accelerator torch reports available); a clear error otherwise."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device name torch knows; use cpu, cuda or cuda:N.") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "meta":
        raise ValueError("device='meta' runs nothing to measure; use cpu or cuda (remat estimate traces on meta itself).")
    backend = getattr(torch, resolved.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(
            f"device={str(device)!r} is not available here (torch {torch.__version__}: "
            f"torch.{resolved.type}.is_available() is False); use --device cpu."
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(
            f"device={str(device)!r}: this machine has {count} {resolved.type} device(s), "
            f"{resolved.type}:0 to {resolved.type}:{count - 1}."
        )
    return resolved


def _check_dtype(dtype: Any) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r} is not a floating torch.dtype; pass e.g. torch.bfloat16, or None to keep float32.")


def _moved(t: Any, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return t.to(device=device, dtype=dtype if t.is_floating_point() else None)


def move_to(built: BuiltModel, device: torch.device | None, dtype: torch.dtype | None = None) -> BuiltModel:
    """``built`` with its model and the batch's tensors on ``device`` (None: where they are),
    floating ones cast to ``dtype`` (None: kept). The parameters change in place, so an
    optimizer made on them still holds them (it must not have state yet)."""
    if built.optimizer is not None and any(built.optimizer.state.values()):
        raise ValueError("the optimizer already has state on the old device; move the model before its first step.")
    built.model.to(device=device, dtype=dtype)
    batch = tree_map(lambda t: _moved(t, device, dtype), built.batch)
    return dataclasses.replace(built, batch=batch)


def load_file_target(spec: str) -> BuiltModel:
    """Import ``path.py`` and call ``function()`` for ``"path.py:function"``."""
    path_text, _, func_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(
            f"file {path_text!r} in {spec!r} does not exist; pass path/to/file.py:function "
            f"or a built-in model ({', '.join(MODEL_NAMES)})."
        )
    module = _import_file(path, spec)
    func = getattr(module, func_name, None)
    if not callable(func):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{path_text} has no function {func_name!r}; callables found: {', '.join(found) or 'none'}. "
            "Name a function that returns (model, batch[, loss_fn[, optimizer]])."
        )
    try:
        result = func()
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module.__name__, None)
        raise _code_error(exc, path, f"{spec} raised") from exc
    return _as_built(result, spec)


def _where(exc: BaseException, path: Path) -> str:
    """`` (path line N)``: the innermost frame of the user's file in ``exc``'s traceback."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return f" ({exc.filename or path} line {exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f" ({path} line {frames[-1].lineno})" if frames else ""


def _code_error(exc: BaseException, path: Path, what: str) -> TargetCodeError:
    if isinstance(exc, SystemExit):
        return TargetCodeError(
            f"{what} SystemExit({exc.code!r}){_where(exc, path)}: sys.exit() or exit() ran instead of returning "
            "(model, batch[, loss_fn[, optimizer]]); return them, and keep script code under "
            "`if __name__ == \"__main__\":`."
        )
    if isinstance(exc, SyntaxError):
        head = f"{path} does not parse: {type(exc).__name__}: {exc.msg}"
    else:
        head = f"{what} {type(exc).__name__}: {exc}"
    return TargetCodeError(f"{head}{_where(exc, path)}; fix the file (remat ran its code), or pass --debug for the traceback.")


def _import_file(path: Path, spec: str) -> Any:
    name = f"remat_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{spec!r}: {str(path)!r} is not a Python file Python can import (it needs the .py suffix); "
                         "pass file.py:function, the file defining the function that builds the model.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # the file may import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise _code_error(exc, path, f"importing {path} for {spec} raised") from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _as_built(result: Any, spec: str) -> BuiltModel:
    if not isinstance(result, (tuple, list)) or not 2 <= len(result) <= 4:
        raise ValueError(
            f"{spec} returned {type(result).__name__}; it must return a tuple "
            "(model, batch[, loss_fn[, optimizer]])."
        )
    model, batch, *rest = result
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec} returned a {type(model).__name__} as the model; return an nn.Module first.")
    loss_fn = rest[0] if rest else None
    optimizer = rest[1] if len(rest) > 1 else None
    return BuiltModel(model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer, name=spec)
