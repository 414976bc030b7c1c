"""Estimate a training step's memory and time on devices this machine does not have.

`estimate` builds the model on the meta device, traces one training step, prices the
strategies none / full / selective / optimal with the planner's model on each device, and
says why a configuration does not fit.
"""

from remat.estimate.api import Estimate, estimate, precision_name
from remat.estimate.devices import DeviceSpec, builtin_devices, load_devices_file, resolve_devices
from remat.estimate.results import DeviceEstimate, StrategyEstimate
from remat.estimate.sources import HF_FAMILIES, ModelSource

__all__ = [
    "HF_FAMILIES",
    "DeviceEstimate",
    "DeviceSpec",
    "Estimate",
    "ModelSource",
    "StrategyEstimate",
    "builtin_devices",
    "estimate",
    "load_devices_file",
    "precision_name",
    "resolve_devices",
]
