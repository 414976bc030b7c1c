"""The models a benchmark runs on: built-in names at named sizes, rebuilt identically on demand.

Uniform chains (every block the same computation): ``gpt``, ``mlp``, ``convnet``, ``hf:gpt2``.
Heterogeneous ones: ``resnet`` (the built-in ConvNet in stages: every second unit halves the
image and doubles the channels), ``unet`` (the built-in U-Net: a down and an up stack joined by
skip connections), ``hf:swin`` (Hugging Face's Swin Transformer from a config, random weights:
stages of windowed-attention blocks with patch merging between them) and ``hf:llama`` (Llama at
a tiny width with a 32000-token vocabulary: the head and the loss outweigh a block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from remat.models import BuiltModel, build

SIZE_NAMES = ("tiny", "small", "large")

# Sizes per model and size name. ``tiny`` keeps the smoke test fast; ``small`` and ``large``
# are the benchmark sizes, chosen so a full run of every model stays within ~15 minutes on a
# shared 2-core CPU while activations still dominate the step's memory.
_SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "tiny": dict(num_layers=4, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64),
        "small": dict(num_layers=4, d_model=128, num_heads=4, seq_len=64, batch_size=8, vocab_size=512),
        "large": dict(num_layers=8, d_model=128, num_heads=4, seq_len=128, batch_size=8, vocab_size=512),
    },
    "mlp": {
        "tiny": dict(depth=9, width=32, batch_size=8),
        "small": dict(depth=32, width=256, batch_size=256),
        "large": dict(depth=64, width=512, batch_size=256),
    },
    "convnet": {
        "tiny": dict(num_blocks=4, channels=4, image_size=8, batch_size=2),
        "small": dict(num_blocks=8, channels=16, image_size=32, batch_size=8),
        "large": dict(num_blocks=16, channels=32, image_size=32, batch_size=16),
    },
    "hf:gpt2": {
        "tiny": dict(num_layers=4, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64),
        "small": dict(num_layers=4, d_model=128, num_heads=4, seq_len=64, batch_size=8, vocab_size=512),
        "large": dict(num_layers=8, d_model=128, num_heads=4, seq_len=128, batch_size=8, vocab_size=512),
    },
    "resnet": {
        "tiny": dict(num_blocks=4, channels=4, image_size=8, batch_size=2, downsample_every=2),
        "small": dict(num_blocks=8, channels=16, image_size=32, batch_size=8, downsample_every=2),
        "large": dict(num_blocks=12, channels=16, image_size=64, batch_size=8, downsample_every=2),
    },
    "unet": {
        "tiny": dict(depth=3, channels=4, image_size=8, batch_size=2),
        "small": dict(depth=4, channels=16, image_size=64, batch_size=4),
        "large": dict(depth=5, channels=16, image_size=128, batch_size=4),
    },
    "hf:swin": {
        "tiny": dict(image_size=16, embed_dim=8, depths=(2, 2), num_heads=(1, 2), window_size=2, batch_size=2),
        "small": dict(image_size=32, embed_dim=32, depths=(2, 2, 4), num_heads=(2, 4, 8), window_size=4,
                      batch_size=8),
        "large": dict(image_size=64, embed_dim=32, depths=(2, 2, 6, 2), num_heads=(1, 2, 4, 8), window_size=4,
                      batch_size=8),
    },
    "hf:llama": {
        "tiny": dict(num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=32000),
        "small": dict(num_layers=4, d_model=64, num_heads=4, seq_len=64, batch_size=4, vocab_size=32000),
        "large": dict(num_layers=8, d_model=128, num_heads=4, seq_len=128, batch_size=4, vocab_size=32000),
    },
}

MODEL_CHOICES = tuple(_SIZES)
HETEROGENEOUS = ("resnet", "unet", "hf:swin", "hf:llama")
"""Workloads whose blocks differ in size (or whose head outweighs a block)."""
_BUILT_IN = {"resnet": "convnet"}
"""Workload name -> the built-in model it builds, where they differ."""


@dataclass(kw_only=True, frozen=True)
class Workload:
    """A model name and its sizes: every `build` gives the same weights and the same batch."""

    model: str
    """Built-in model name, e.g. ``"gpt"`` or ``"hf:gpt2"``."""
    size: str
    """``tiny``, ``small`` or ``large``."""
    device: str = "cpu"
    """Device type the model and batch are moved to."""
    seed: int = 0
    """Seed of the weights and of the batch."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Size keywords that replace the named size's values."""

    def __post_init__(self) -> None:
        if self.model not in _SIZES:
            raise ValueError(f"unknown model {self.model!r}; allowed: {', '.join(MODEL_CHOICES)}.")
        if self.size not in SIZE_NAMES:
            raise ValueError(f"unknown size {self.size!r}; allowed: {', '.join(SIZE_NAMES)}.")

    @property
    def sizes(self) -> dict[str, Any]:
        return {**_SIZES[self.model][self.size], **self.overrides}

    @property
    def label(self) -> str:
        return f"{self.model} ({self.size})"

    @property
    def heterogeneous(self) -> bool:
        return self.model in HETEROGENEOUS

    def build(self) -> BuiltModel:
        """A fresh model (training mode, on the device), its batch and loss; no optimizer."""
        if self.model == "hf:swin":
            built = _build_swin(self.seed, **self.sizes)
        else:
            built = build(_BUILT_IN.get(self.model, self.model), seed=self.seed, optimizer="none", **self.sizes)
        model = built.model.to(self.device)
        if hasattr(model, "config") and hasattr(model.config, "use_cache"):
            # Training never reads the KV cache; HF's gradient checkpointing turns it off too.
            model.config.use_cache = False
        return BuiltModel(
            model=model, batch=_to_device(built.batch, self.device), loss_fn=built.loss_fn,
            optimizer=None, name=built.name,
        )


SWIN_NUM_LABELS = 10


def _build_swin(seed: int, *, image_size: int, embed_dim: int, depths: tuple[int, ...], num_heads: tuple[int, ...],
                window_size: int, batch_size: int) -> BuiltModel:
    """``SwinForImageClassification`` from a config (patch size 2, eager attention, random weights)
    and a batch ``dict(pixel_values, labels)``; the loss is ``output.loss``."""
    import torch
    import transformers

    config = transformers.SwinConfig(image_size=image_size, patch_size=2, embed_dim=embed_dim, depths=list(depths),
                                     num_heads=list(num_heads), window_size=window_size, num_labels=SWIN_NUM_LABELS)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.SwinForImageClassification(config)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    batch = {"pixel_values": torch.randn((batch_size, 3, image_size, image_size), generator=generator),
             "labels": torch.randint(0, SWIN_NUM_LABELS, (batch_size,), generator=generator)}
    return BuiltModel(model=model, batch=batch, loss_fn=None, optimizer=None, name="hf:swin")


def _to_device(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t.to(device) for t in batch)
    return batch.to(device)


def recipe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the blocks a per-block recipe wraps: the members of every
    innermost stack (a list of two or more same-class modules with parameters holding no such list
    inside a member: a transformer's layers, the down and up blocks of a U-Net, the blocks of each
    Swin stage), in module order."""
    from remat.measure.blocks import inside, members, stack_lists

    names = stack_lists(model)
    innermost = [n for n in names if not any(inside(other, n) for other in names if other != n)]
    if not innermost:
        raise ValueError(f"{type(model).__name__} has no list of blocks; the per-block peers need one.")
    return [member for name in innermost for member in members(model, name)]


def block_list(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The longest ``nn.ModuleList`` of the model: ``(parent, attribute, list)``."""
    best: tuple[nn.Module, str, nn.ModuleList] | None = None
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and (best is None or len(child) > len(best[2])):
                best = (parent, attr, child)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks; the per-block peers need one."
        )
    return best
