"""remat: the fastest PyTorch training step that fits your memory.

Pipeline: ``profile`` (measure the real model) -> ``plan`` (choose per block between keeping,
recomputing and offloading activations under a byte budget) -> ``apply_`` (change the model in
place) -> ``verify`` (identical gradients, predicted vs measured) -> report. ``estimate`` does the
same arithmetic on the meta device for models and devices this machine does not have.

Importing remat is cheap and never initialises CUDA: the API is loaded on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_API = {
    "profile": "remat.measure.profile",
    "Profile": "remat.measure.types",
    "plan": "remat.plan.planners",
    "pareto": "remat.plan.planners",
    "predict": "remat.plan.predict",
    "parse_budget": "remat.plan.budget",
    "Plan": "remat.plan.types",
    "Segment": "remat.plan.types",
    "Prediction": "remat.plan.types",
    "apply_": "remat.apply.api",
    "remove_": "remat.apply.api",
    "auto_": "remat.apply.api",
    "tune": "remat.apply.tune",
    "Tuner": "remat.apply.tune",
    "verify": "remat.verify",
    "Verification": "remat.verify_types",
    "estimate": "remat.estimate.api",
}

__all__ = sorted(_API) + ["__version__"]


class _RematModule(types.ModuleType):
    """`remat.plan`, `remat.verify` and `remat.estimate` are functions that share their names
    with submodules. Importing such a submodule makes Python bind it on the package, which would
    hide the function: keep the function (the submodule stays importable by its full name)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _API:
            self.__dict__.pop(name, None)  # unbound: the next access loads the function
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _RematModule


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # a subpackage (remat.models): bound on import
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
