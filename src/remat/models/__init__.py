"""Built-in example models: each builds with random weights and makes its own batch.

``build(name, **sizes)`` returns a `BuiltModel` (model, batch, loss_fn, optimizer, name);
`MODEL_NAMES` lists the names (``hf:*`` only when transformers imports).
"""

from __future__ import annotations

from remat.models.loading import SIZE_OPTIONS, TargetCodeError, load_target, sizes_from_options
from remat.models.registry import MODEL_NAMES, BuiltModel, build, make_optimizer, model_sizes

__all__ = ["MODEL_NAMES", "SIZE_OPTIONS", "TargetCodeError", "sizes_from_options", "BuiltModel", "build", "load_target", "make_optimizer", "model_sizes"]
