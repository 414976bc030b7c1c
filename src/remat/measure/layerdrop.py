"""LayerDrop off while remat measures: every layer runs in the steps it profiles and verifies.

In training, a model with LayerDrop skips each layer at random (Hugging Face's wav2vec2, HuBERT
and WavLM draw ``torch.rand([]) < config.layerdrop`` per layer, BART-like encoders and decoders
``self.layerdrop``, from ``config.encoder_layerdrop`` and ``config.decoder_layerdrop``;
x-transformers' ``AttentionLayers`` ``random() < layer_dropout`` from ``self.layer_dropouts``, a
rate per layer). A profile
must see every block run once (`remat.measure.stacks`), and a measured peak must be the step's
with every layer: a step that skips layers runs less and holds no more. So `remat.profile` and
`remat.verify` set those rates to 0 while they run and put them back after (`LayerDropOff`);
under an applied plan, training skips layers as before.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["LayerDropOff", "CONFIG_FIELDS"]

CONFIG_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
"""Config attributes of a LayerDrop rate (Hugging Face); any other attribute whose name ends in
``layerdrop``, ``layer_drop``, ``layer_dropout`` or ``layer_dropouts`` counts too (SeamlessM4T's
``speech_encoder_layerdrop``, x-transformers' ``layer_dropouts``)."""

_RATE_NAME = re.compile(r"layer_?drop(out)?s?$", re.IGNORECASE)


def _rate_fields(owner: Any, known: tuple[str, ...]) -> list[str]:
    """``known`` and every attribute of ``owner``'s own named as a LayerDrop rate (`CONFIG_FIELDS`)."""
    own = [name for name in vars(owner) if _RATE_NAME.search(name)] if hasattr(owner, "__dict__") else []
    return list(dict.fromkeys([*known, *own]))


def _off(rate: Any) -> Any:
    """``rate`` at 0: a positive float, or a tuple or list of rates (one per layer) with one
    positive, as zeros of the same type; None where ``rate`` is no such rate."""
    if isinstance(rate, float) and rate > 0.0:
        return 0.0
    if isinstance(rate, (tuple, list)) and rate and all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                                       for r in rate) and any(r > 0 for r in rate):
        return type(rate)(0.0 for _ in rate)
    return None


class LayerDropOff:
    """``with LayerDropOff(model): ...`` (or `install`, `remove`): every LayerDrop rate of ``model`` (its modules' configs'
    `CONFIG_FIELDS` and modules' own attributes named so) is 0 inside, as it was after.
    ``changed`` names what was set, ``'<owner>.<field>'``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._saved: list[tuple[Any, str, float]] = []

    @property
    def changed(self) -> list[str]:
        return [f"{type(owner).__name__}.{field}" for owner, field, _ in self._saved]

    def install(self) -> LayerDropOff:
        seen: set[int] = set()
        for module in self.model.modules():
            config = getattr(module, "config", None)
            for owner, fields in ((config, CONFIG_FIELDS), (module, ("layerdrop",))):
                if owner is None or id(owner) in seen and owner is config:
                    continue
                if owner is config:
                    seen.add(id(config))
                for field in _rate_fields(owner, fields):
                    rate = getattr(owner, field, None) if owner is config else vars(owner).get(field)
                    off = _off(rate)
                    if off is not None:
                        self._saved.append((owner, field, rate))
                        setattr(owner, field, off)
        return self

    def remove(self) -> None:
        for owner, field, rate in reversed(self._saved):
            setattr(owner, field, rate)
        self._saved.clear()

    def __enter__(self) -> LayerDropOff:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()
