"""Estimate a training step's memory and time on devices this machine does not have.

`estimate` builds the model on the meta device, traces one training step, divides what it
saves and computes by a parallel layout (data, tensor, sequence, pipeline, context, expert
parallelism), prices the strategies none / full / selective / optimal per GPU on each device
with the LM head and loss kept or chunked (`remat.estimate.head`), and says why a
configuration does not fit. `search` lists the fastest layouts that fit a number of GPUs.
"""

from remat.estimate.api import Estimate, estimate, precision_name
from remat.estimate.devices import DeviceSpec, builtin_devices, load_devices_file, resolve_devices
from remat.estimate.fastest import Candidate, SearchSpace
from remat.estimate.fastest import search_source as search
from remat.estimate.parallel import Parallelism
from remat.estimate.results import DeviceEstimate, HeadEstimate, StepTime, StrategyEstimate
from remat.estimate.sources import HF_FAMILIES, ModelSource

__all__ = [
    "HF_FAMILIES",
    "Candidate",
    "DeviceEstimate",
    "DeviceSpec",
    "Estimate",
    "HeadEstimate",
    "ModelSource",
    "SearchSpace",
    "Parallelism",
    "StepTime",
    "StrategyEstimate",
    "builtin_devices",
    "estimate",
    "load_devices_file",
    "precision_name",
    "resolve_devices",
    "search",
]
