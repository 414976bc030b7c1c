"""The models a benchmark runs on: built-in names at named sizes, rebuilt identically on demand."""

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
}

MODEL_CHOICES = tuple(_SIZES)


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

    def build(self) -> BuiltModel:
        """A fresh model (training mode, on the device), its batch and loss; no optimizer."""
        built = build(self.model, seed=self.seed, optimizer="none", **self.sizes)
        model = built.model.to(self.device)
        if hasattr(model, "config") and hasattr(model.config, "use_cache"):
            # Training never reads the KV cache; HF's gradient checkpointing turns it off too.
            model.config.use_cache = False
        return BuiltModel(
            model=model, batch=_to_device(built.batch, self.device), loss_fn=built.loss_fn,
            optimizer=None, name=built.name,
        )


def _to_device(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t.to(device) for t in batch)
    return batch.to(device)


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
