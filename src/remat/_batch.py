"""The calling convention shared by every entry point (profile, plan, apply_, verify, auto_).

A batch is a tensor (``model(batch)``), a tuple or list (``model(*batch)``) or a dict
(``model(**batch)``). ``loss_fn(output, batch)`` returns a scalar; without one the output
must be a scalar tensor or carry a scalar ``.loss`` (as Hugging Face outputs do) or a ``"loss"``
entry."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

LossFn = Callable[[Any, Any], torch.Tensor]


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch, in a stable order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for k in sorted(batch) for t in batch_tensors(batch[k])]
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in batch_tensors(item)]
    return []


def batch_shapes(batch: Any) -> tuple[str, ...]:
    """Shapes and dtypes of the batch's tensors, e.g. ``("4x128:int64",)``."""
    return tuple(
        "x".join(str(d) for d in t.shape) + ":" + str(t.dtype).removeprefix("torch.")
        for t in batch_tensors(batch)
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a stateless model."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def check_batch_device(model: nn.Module, batch: Any) -> None:
    """Raise if a batch tensor lives on another device than the model."""
    device = model_device(model)
    for t in batch_tensors(batch):
        if t.device.type != device.type or (
            t.device.index is not None and device.index is not None and t.device.index != device.index
        ):
            raise ValueError(
                f"batch tensor of shape {tuple(t.shape)} is on {t.device} but the model is on "
                f"{device}; move the batch with .to({str(device)!r}) before calling remat."
            )


def check_model(model: nn.Module, where: str) -> None:
    """Raise for a model remat cannot measure or change as given (`check_not_compiled`,
    `check_no_hf_checkpointing`, `check_no_torch_checkpointing`)."""
    check_no_inference_tensors(model, where)
    check_not_compiled(model, where)
    check_not_scripted(model, where)
    check_not_fsdp1(model, where)
    check_no_per_sample_grads(model, where)
    check_no_hf_checkpointing(model, where)
    check_no_torch_checkpointing(model, where)


def check_no_inference_tensors(model: nn.Module, where: str) -> None:
    """Raise if a parameter of ``model`` is an inference tensor (made under ``torch.inference_mode()``):
    it can never be trained, and torch said so from deep inside the step ("Inplace update to inference
    tensor outside InferenceMode is not allowed")."""
    made = [name for name, p in model.named_parameters() if p.is_inference()]
    if made:
        shown = ", ".join(made[:3]) + (f" and {len(made) - 3} more" if len(made) > 3 else "")
        raise ValueError(f"{where}: the parameters of {type(model).__name__} were made under torch.inference_mode() "
                         f"({shown}): inference tensors cannot be trained. Build or load the model outside "
                         "inference_mode.")


def check_grad_enabled(where: str) -> None:
    """Raise if gradients are disabled where ``where`` is called: it runs a training step."""
    if not torch.is_grad_enabled():
        raise ValueError(f"{where} runs a training step, and gradients are disabled where it was called "
                         "(torch.is_grad_enabled() is False: inside torch.no_grad(), torch.inference_mode() or "
                         "torch.set_grad_enabled(False)); call it outside that block.")


PER_SAMPLE = ("per-sample gradients (Opacus's GradSampleModule) are computed by hooks that keep each layer's "
              "input from its forward and pair it with the backward's gradient: a replay runs the forward again, and "
              "the pairs no longer match (12 of 16 parameters lost their per-sample gradients, as under torch's own "
              "checkpoint)")
"""Why remat refuses a model whose parameters Opacus counts forwards of (``_forward_counter``)."""


def check_no_per_sample_grads(model: nn.Module, where: str) -> None:
    """Raise if Opacus's per-sample gradient hooks are on ``model`` (`PER_SAMPLE`)."""
    if any(hasattr(p, "_forward_counter") for p in model.parameters()):
        raise ValueError(f"{where}: {PER_SAMPLE}. Train with Opacus without a remat plan.")


def check_not_fsdp1(model: nn.Module, where: str) -> None:
    """Raise if ``model`` is or holds FSDP1's wrapper (``FullyShardedDataParallel``): its
    parameters are flattened shards gathered by the wrapper's own forward, which remat's probes of
    a block alone never run (the profile raised on shapes of 0 or the flat parameter's), and its
    memory (flat parameters gathered by resizing storages) is not what the step's tracker sees."""
    wrapped = [name or "<root>" for name, m in model.named_modules() if type(m).__name__ == "FullyShardedDataParallel"]
    if wrapped:
        what = ("the model is FSDP's wrapper (FullyShardedDataParallel" if wrapped[0] == "<root>" else
                f"{type(model).__name__} holds FSDP wrappers (FullyShardedDataParallel")
        raise ValueError(
            f"{where}: {what}: {', '.join(wrapped[:3])}{', ...' if len(wrapped) > 3 else ''}). remat profiles and plans the model before it is wrapped: profile "
            "the unwrapped model, shard_profile it (remat.distributed), apply_ the plan, then shard with FSDP2 "
            "(remat.distributed.fully_shard_by_plan), whose per-rank peak remat predicts (README, \"With torchrun, "
            "FSDP2 and DDP\"). FSDP1 wrapped after apply_ trains as without remat, but its peak is not predicted and "
            "each recompute segment must be one block (strategy 'full', or 'every:1')."
        )


def check_no_torch_checkpointing(model: nn.Module, where: str) -> None:
    """Raise if torch's module-level activation checkpointing is on in ``model``: a
    ``checkpoint_wrapper`` (or ``offload_wrapper``) around a module, torchtitan's way, or the
    composable ``torch.distributed._composable.checkpoint``. Its modules already recompute (the
    profile saw 0 bytes saved there and a plan checkpointed them twice, a layer's forward ran
    twice more per step), with no word."""
    registry = None
    try:
        from torch.distributed._composable.contract import _get_registry as registry
    except ImportError:  # a build without torch.distributed
        pass
    wrapped = [name or "<root>" for name, m in model.named_modules()
               if any(c.__name__ == "ActivationWrapper" for c in type(m).__mro__)
               or (registry is not None and "checkpoint" in (registry(m) or {}))]
    if wrapped:
        raise ValueError(
            f"{where}: torch's activation checkpointing is on in {type(model).__name__} ({', '.join(wrapped[:3])}"
            f"{', ...' if len(wrapped) > 3 else ''}: checkpoint_wrapper, offload_wrapper or "
            "torch.distributed._composable.checkpoint), so those modules already recompute and remat would measure "
            "and plan checkpointed layers. Build the model without it (or unwrap: CheckpointWrapper's "
            "_checkpoint_wrapped_module): a remat plan replaces it."
        )


def check_not_compiled(model: nn.Module, where: str) -> None:
    """Raise if ``model`` is ``torch.compile``'s wrapper: remat measures and changes the model
    before it is compiled (its blocks' hooks and checkpoints must be in the graph the compiler
    traces), so a compiled model would be measured as traced before, and verified against it."""
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ValueError(
            f"{where} takes the model before torch.compile, got torch.compile's wrapper (OptimizedModule of "
            f"{type(model._orig_mod).__name__}). Pass the module it wraps (model._orig_mod) and compile after "
            "remat.apply_: profile with remat.profile(..., compiled=True) to plan for the compiled step "
            "(README, \"Compiled mode\")."
        )


def check_not_scripted(model: nn.Module, where: str) -> None:
    """Raise if ``model`` or a module in it is a TorchScript module (``torch.jit.script`` or
    ``torch.jit.trace``): it runs its compiled graph, which no module hook or checkpoint can
    enter, so remat could neither see its layers' calls nor replay them."""
    scripted = [name or "<root>" for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise ValueError(
            f"{where} takes an eager nn.Module, but {type(model).__name__} holds TorchScript modules "
            f"({', '.join(scripted[:3])}{', ...' if len(scripted) > 3 else ''}): a scripted or traced module runs its "
            "compiled graph, whose layers no hook sees and no checkpoint can replay. Pass the module before "
            "torch.jit.script / torch.jit.trace (script it, if you must, after training), or torch.compile it after "
            "remat.apply_ (README, \"Compiled mode\")."
        )


def check_no_hf_checkpointing(model: nn.Module, where: str) -> None:
    """Raise if Hugging Face's (or diffusers', or timm's: ``set_grad_checkpointing``, which sets
    ``grad_checkpointing`` on the model or its stages) gradient checkpointing is on in ``model``:
    its layers would already recompute, so remat would measure checkpointed layers (nothing
    saved, nothing to plan) and a plan would checkpoint them twice."""
    timm = [name or "<root>" for name, m in model.named_modules() if getattr(m, "grad_checkpointing", False) is True
            ] if any(hasattr(m, "set_grad_checkpointing") for m in model.modules()) else []
    if timm:  # timm's models checkpoint their stages themselves when set so
        raise ValueError(
            f"{where}: timm's gradient checkpointing is on in {type(model).__name__} ({', '.join(timm[:3])}"
            f"{', ...' if len(timm) > 3 else ''}), so its blocks already recompute and remat would measure and plan "
            "checkpointed blocks (nothing saved in them). Call model.set_grad_checkpointing(False) first: a remat plan "
            "replaces it."
        )
    on = [name or "<root>" for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        if hasattr(model, "disable_gradient_checkpointing"):  # diffusers' models name it so
            library, fix = "diffusers", "model.disable_gradient_checkpointing() first"
        else:
            library, fix = "Hugging Face", ("model.gradient_checkpointing_disable() first (activation_checkpointing_disable() "
                                            "in transformers 5)")
        raise ValueError(
            f"{where}: {library} gradient checkpointing is on in {type(model).__name__} ({', '.join(on[:3])}"
            f"{', ...' if len(on) > 3 else ''}), so its layers already recompute and remat would measure and plan "
            f"checkpointed layers. Call {fix}: a remat plan replaces it."
        )


def check_step_inputs(optimizer: Any, where: str, loss_fn: Any = None) -> None:
    """Raise for what remat cannot run as a training step: a ``loss_fn`` that is not callable or
    an ``optimizer`` without ``step`` (another argument passed in their place), an optimizer whose
    ``step`` needs a closure (LBFGS re-evaluates the model inside it), or a call inside
    ``torch.autocast`` (its weight-cast cache lives until the outermost autocast exits, so the
    casts a replay makes would be measured as already made: predicted peaks 4-9 % under)."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn must be a function of (output, batch) returning the loss, or None to take the "
            f"model's own (output.loss or output[0]); got a {type(loss_fn).__name__}. After the model and the batch "
            "come loss_fn, then optimizer: pass what else you meant by keyword (optimizer=...)."
        )
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer (an object with step()), or None for a step "
            f"without one; got a {type(optimizer).__name__}. After the model and the batch come loss_fn, then "
            "optimizer: pass what else you meant by keyword."
        )
    if optimizer is not None and type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        inner = getattr(getattr(optimizer, "_optim_constructor", None), "__name__", "the optimizer it wraps")
        raise ValueError(
            f"{where}: ZeroRedundancyOptimizer shards its state over the ranks and steps collectively, so one rank "
            f"cannot copy, restore or step it alone. Profile with the optimizer it wraps ({inner}, on the model's "
            "parameters) and share the state with remat.distributed.shard_profile(profile, world_size=..., zero_stage=1); "
            "apply the plan and train with ZeroRedundancyOptimizer as before (README, \"With torchrun, FSDP2 and DDP\")."
        )
    if optimizer is not None:
        step = getattr(type(optimizer), "step", None)
        params = list(inspect.signature(step).parameters.values())[1:] if callable(step) else []
        if any(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params):
            raise ValueError(
                f"{where}: {type(optimizer).__name__}.step needs a closure (it re-evaluates the model), which remat's "
                "step (forward, backward, optimizer.step()) cannot give it. Pass optimizer=None (the plan then holds "
                "no optimizer state or step), or an optimizer whose step() takes no argument."
            )
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if on:
        raise ValueError(
            f"{where} was called inside torch.autocast ({', '.join(on)}): autocast's weight-cast cache then lives "
            "across remat's whole step, so the casts a replay makes would be measured as made already. Enter "
            "autocast inside the model's forward instead (a wrapper module whose forward runs the model under "
            "torch.autocast), and call remat outside it; README, \"Mixed precision\"."
        )


def call_arguments(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments the calling convention passes to the model."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise TypeError(
        f"batch of type {type(batch).__name__} is not supported; pass a tensor (model(batch)), "
        "a tuple/list (model(*batch)) or a dict (model(**batch))."
    )


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` on ``batch`` by the calling convention."""
    args, kwargs = call_arguments(batch)
    return model(*args, **kwargs)


def compute_loss(output: Any, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar loss of one forward, by the calling convention (a one-element tensor is taken
    as a scalar, as ``Tensor.backward()`` takes it)."""
    if loss_fn is not None:
        loss = loss_fn(output, batch)
        where = "loss_fn(output, batch)"
    elif isinstance(output, torch.Tensor):
        loss, where = output, "the model output"
    elif getattr(output, "loss", None) is not None:
        loss, where = output.loss, "output.loss"
    elif isinstance(output, Mapping) and output.get("loss") is not None:  # a plain dict, as ModelOutput is one
        loss, where = output["loss"], "output['loss']"
    else:
        raise TypeError(
            f"the model returned {type(output).__name__}, not a scalar tensor, and no loss_fn was "
            "given (nor a .loss or a 'loss' entry); pass loss_fn=lambda output, batch: <scalar>, or return "
            "the loss from forward."
        )
    if isinstance(loss, torch.Tensor) and loss.dim() != 0 and loss.numel() == 1:
        return loss.reshape(())  # one element (OneFormer's loss is of shape (1,)): backward takes it as a scalar
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"{where} must be a scalar tensor, got shape {shape}; reduce it (for example "
            ".mean() or .sum()) or pass a loss_fn that returns a scalar."
        )
    if torch.is_grad_enabled() and not loss.requires_grad and loss.device.type != "meta":
        raise ValueError(
            f"{where} needs no gradient: no parameter the step used requires grad (all frozen?) and no input "
            "does, so there is no backward to train or to plan. Leave the parameters to train with requires_grad "
            "(model.requires_grad_() for all), or pass a batch whose inputs require grad. Trained parameters used only "
            "inside a custom autograd Function whose input comes from frozen embeddings (Reformer's reversible "
            "layers with LoRA adapters) give the loss no gradient either: on a Hugging Face model, "
            "model.enable_input_require_grads() makes the embeddings' output require one."
        )
    return loss


def forward_backward(model: nn.Module, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """One forward and backward; returns the detached loss."""
    loss = compute_loss(call_model(model, batch), batch, loss_fn)
    loss.backward()
    return loss.detach()
