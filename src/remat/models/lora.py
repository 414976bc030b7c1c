"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear layers, every other weight frozen.

`add_lora` turns each ``nn.Linear`` of a model but its output embeddings (the LM head) into a
`LoRALinear` (a subclass of it, Falcon's ``FalconLinear``, into a LoRA subclass of its own; not a
subclass that computes something else than a linear map, `plain_linear`), and
each of transformers' ``Conv1D`` (GPT-2's linear layers, their weight stored in x out) into a
``LoRAConv1D``, as peft adapts both (or only those named in ``targets``): the same module, its
weight and bias frozen, with two trained matrices beside it, ``lora_A`` (rank x in) and ``lora_B``
(out x rank), whose product is added to its output, scaled by ``alpha / rank`` (``alpha`` 8 unless
given, peft's default), its input dropped by ``lora_dropout`` first (peft's, 0 unless given);
every other parameter (embeddings, norms, the head, experts kept as 3-D tensors) is frozen. This
is peft's ``LoraConfig(target_modules="all-linear")`` (its default ``init_lora_weights``:
``lora_B`` starts at zero), with the parameter names of the linear kept (``q_proj.weight``,
``q_proj.lora_A.weight``), so what names a linear (tensor parallel plans) names it still. With
peft's weights loaded (its names less ``base_model.model.``, ``.base_layer`` and ``.default``), a
step's loss and every gradient are bit-identical to peft's (0.21.2, Llama and GPT-2, and with
dropout 0.1 from the same seed). `remat.estimate` applies it with ``--lora R``; a model built
here with it and profiled measures the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a frozen weight and a trained low-rank update (module docstring)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` (``x @ weight + bias``, weight in x out), or None without transformers."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    """The LoRA subclass of ``nn.Linear``, of a subclass of it (Falcon's ``FalconLinear``) or of
    transformers' ``Conv1D``: the layer's own output plus the scaled update."""
    if base is nn.Linear:
        return LoRALinear
    if base not in _LORA_CLASSES:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return base.forward(self, x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

        name = "LoRAConv1D" if base is conv1d_class() else f"LoRA{base.__name__}"
        _LORA_CLASSES[base] = type(name, (base,), {"forward": forward, "__module__": __name__, "__doc__": (
            f"{base.__name__} with a frozen weight and a trained low-rank update (module docstring).")})
    return _LORA_CLASSES[base]


def is_lora(module: nn.Module) -> bool:
    """True for a linear layer `add_lora` adapted."""
    return isinstance(module, LoRALinear) or type(module) in _LORA_CLASSES.values()


def _adaptable(module: nn.Module) -> bool:
    """A linear layer peft's ``all-linear`` adapts: an ``nn.Linear`` or a subclass of it that
    computes one (`plain_linear`), or transformers' ``Conv1D``; not one adapted already, nor
    torch's ``NonDynamicallyQuantizableLinear``, the output projection of ``nn.MultiheadAttention``,
    which reads its weight directly (the adapter would never run)."""
    if is_lora(module) or type(module) is nn.modules.linear.NonDynamicallyQuantizableLinear:
        return False
    conv1d = conv1d_class()
    return plain_linear(module) or (conv1d is not None and type(module) is conv1d)


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` that maps ``in_features`` to ``out_features`` as one:
    ``nn.Linear`` itself or a subclass that keeps its forward, or whose own forward, tried on two
    rows of zeros (on the weight's device: the meta device for an estimate), returns one tensor of
    two rows of ``out_features`` (Falcon's ``FalconLinear``). Not a subclass that computes something
    else with its weight, to which an adapter's ``in x out`` update cannot be added:
    DeepSeek-V4's grouped output projection (a block-diagonal product over groups of its input's
    last two dimensions), Phi-MoE's router (it returns the routing weights and the experts picked)."""
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    weight = module.weight
    try:
        with torch.no_grad():
            out = type(module).forward(module, torch.zeros(2, module.in_features, dtype=weight.dtype, device=weight.device))
    except Exception:  # noqa: BLE001 - a forward for other shapes: not a plain linear
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, module.out_features)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer: ``nn.Linear``'s weight is out x in, ``Conv1D``'s in x out."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def add_lora(model: nn.Module, rank: int, *, alpha: float = 8,
             targets: Sequence[str] | None = None, dropout: float = 0.0) -> nn.Module:
    """``model`` with LoRA of ``rank`` on every linear layer but its output embeddings, in place
    (module docstring), or on those whose name ends in one of ``targets`` (peft's
    ``target_modules`` as names: ``("q_proj", "v_proj")``, its default for Llama); returns it.
    ``dropout``: peft's ``lora_dropout``, applied to the adapter's input alone (an ``nn.Dropout``
    named ``lora_dropout``; ``nn.Identity`` at 0, as peft has it): the dropped input and its mask
    are what ``lora_A`` saves for its weight's gradient."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}.")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be a probability in [0, 1), got {dropout!r} (--lora-dropout P).")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linears = [(n, m) for n, m in model.named_modules() if _adaptable(m) and m is not head]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear (nor transformers' Conv1D) besides its output "
                         "embeddings for LoRA to adapt; drop --lora.")
    if targets is not None:
        wanted = set(targets)
        found = [(n, m) for n, m in linears if n.rsplit(".", 1)[-1] in wanted]
        missing = sorted(wanted - {n.rsplit(".", 1)[-1] for n, _ in found})
        if missing:
            names = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
            raise ValueError(f"LoRA targets {missing} name no linear layer of {type(model).__name__}; its linear "
                             f"layers are named {', '.join(names)}. Pass --lora-targets with some of those, or leave it "
                             "out for all of them.")
        linears = found
    targets = [m for _, m in linears]
    for p in model.parameters():
        p.requires_grad_(False)
    for linear in targets:
        w = linear.weight
        features_in, features_out = _features(linear)
        linear.__class__ = _lora_class(type(linear))
        linear.lora_A = nn.Linear(features_in, rank, bias=False, device=w.device, dtype=w.dtype)
        linear.lora_B = nn.Linear(rank, features_out, bias=False, device=w.device, dtype=w.dtype)
        if w.device.type != "meta":
            nn.init.kaiming_uniform_(linear.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(linear.lora_B.weight)
        linear.scaling = alpha / rank
        linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    return model


__all__ = ["LoRALinear", "add_lora", "conv1d_class", "is_lora", "plain_linear"]
