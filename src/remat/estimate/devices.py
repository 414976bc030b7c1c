"""Device specs: a built-in table (``data/devices.json``, each value with its source) and user files.

A user file (JSON or TOML) lists devices with the same fields, for example in TOML::

    [[devices]]
    name = "MyGPU-48GB"
    memory_bytes = 51539607552
    peak_bf16_flops_per_s = 362e12
    peak_fp32_flops_per_s = 91.6e12   # optional; needed for --dtype fp32
    memory_bytes_per_s = 864e9        # optional
    host_link_bytes_per_s = 32e9      # optional
    gpu_link_bytes_per_s = 32e9       # optional: GPU to GPU in a node, one direction
    gpus_per_node = 8                 # optional
    network_bytes_per_s = 25e9        # optional: between nodes, per GPU, one direction
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

_REQUIRED = ("name", "memory_bytes", "peak_bf16_flops_per_s")
_OPTIONAL = ("description", "peak_fp32_flops_per_s", "memory_bytes_per_s", "host_link_bytes_per_s",
             "gpu_link_bytes_per_s", "gpus_per_node", "network_bytes_per_s", "sources")


@dataclass(kw_only=True, frozen=True)
class DeviceSpec:
    """What estimate needs to know about one accelerator."""

    name: str
    """Short name used on the command line, e.g. ``"H100-80GB"``."""
    memory_bytes: int
    """Device memory in bytes."""
    peak_bf16_flops_per_s: float
    """Peak dense BF16 tensor FLOP/s."""
    peak_fp32_flops_per_s: float | None = None
    """Peak dense FP32 FLOP/s as PyTorch runs float32 matmuls by default (``allow_tf32`` off):
    the CUDA cores' rate on NVIDIA GPUs, the matrix cores' on AMD's; what ``--dtype fp32``
    prices at (None: unknown, and an fp32 estimate for the device is refused)."""
    memory_bytes_per_s: float | None = None
    """Device memory bandwidth."""
    host_link_bytes_per_s: float | None = None
    """Host link bandwidth, one direction (offload)."""
    gpu_link_bytes_per_s: float | None = None
    """GPU-to-GPU bandwidth inside a node, one direction (NVLink, Infinity Fabric; None: the host link)."""
    gpus_per_node: int | None = None
    """GPUs sharing that link in the vendor's standard node (None: 8)."""
    network_bytes_per_s: float | None = None
    """Between nodes, per GPU, one direction (None: `remat.estimate.pricing.DEFAULT_NETWORK_BYTES_PER_S`)."""
    description: str = ""
    """Full product name."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each value comes from (field name -> datasheet and figure)."""

    def peak_flops_per_s(self, precision: str) -> float:
        """The peak rate a step of ``precision`` (`remat.memory.model_state` recipe names) runs
        its matmuls at: FP32's for ``fp32``, BF16's otherwise."""
        if precision != "fp32":
            return self.peak_bf16_flops_per_s
        if self.peak_fp32_flops_per_s is None:
            raise ValueError(
                f"device {self.name!r} has no peak_fp32_flops_per_s: an fp32 step runs its matmuls far below the "
                f"BF16 rate ({self.peak_bf16_flops_per_s:.3g} FLOP/s); add the FP32 rate to a devices file "
                "(--devices-file) or estimate --dtype bf16."
            )
        return self.peak_fp32_flops_per_s

    def __post_init__(self) -> None:
        if self.peak_fp32_flops_per_s is not None and self.peak_fp32_flops_per_s <= 0:
            raise ValueError(f"device {self.name!r}: peak_fp32_flops_per_s={self.peak_fp32_flops_per_s} must be "
                             "positive; fix the device file.")
        if self.memory_bytes <= 0 or self.peak_bf16_flops_per_s <= 0:
            raise ValueError(
                f"device {self.name!r}: memory_bytes={self.memory_bytes} and peak_bf16_flops_per_s="
                f"{self.peak_bf16_flops_per_s} must both be positive; fix the device file."
            )


def _spec(entry: Mapping[str, Any], where: str) -> DeviceSpec:
    missing = [k for k in _REQUIRED if k not in entry]
    unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise ValueError(
            f"device entry {dict(entry).get('name', '?')!r} in {where}: missing {missing}, unknown {unknown}; "
            f"required fields: {', '.join(_REQUIRED)}; optional: {', '.join(_OPTIONAL)}."
        )
    values = dict(entry)
    values["memory_bytes"] = int(values["memory_bytes"])
    values["peak_bf16_flops_per_s"] = float(values["peak_bf16_flops_per_s"])
    if "peak_fp32_flops_per_s" in values:
        values["peak_fp32_flops_per_s"] = float(values["peak_fp32_flops_per_s"])
    return DeviceSpec(**values)


def builtin_devices() -> dict[str, DeviceSpec]:
    """The built-in table, name -> spec."""
    text = resources.files("remat.estimate").joinpath("data/devices.json").read_text()
    return {d.name: d for d in (_spec(e, "devices.json") for e in json.loads(text)["devices"])}


def load_devices_file(path: str | Path) -> dict[str, DeviceSpec]:
    """Devices from a user's ``.json`` or ``.toml`` file with a ``devices`` list."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"devices file {str(path)!r} does not exist; pass a .json or .toml file with a 'devices' list.")
    if path.suffix == ".toml":
        data = tomllib.loads(path.read_text())
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
    else:
        raise ValueError(f"devices file {str(path)!r} must end in .json or .toml, got {path.suffix!r}.")
    entries = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"devices file {str(path)!r} has no 'devices' list; see remat.estimate.devices for the format.")
    return {d.name: d for d in (_spec(e, str(path)) for e in entries)}


def resolve_devices(names: Iterable[str], devices_file: str | Path | None = None) -> tuple[DeviceSpec, ...]:
    """Specs for ``names`` from the built-in table and the user's file (the file wins on a clash)."""
    table = builtin_devices()
    if devices_file is not None:
        table.update(load_devices_file(devices_file))
    lookup = {k.lower(): v for k, v in table.items()}
    out = []
    for name in names:
        if name.lower() not in lookup:
            raise ValueError(
                f"unknown device {name!r}; known: {', '.join(table)}. Add it with a devices file "
                "(--devices-file) listing name, memory_bytes and peak_bf16_flops_per_s."
            )
        out.append(lookup[name.lower()])
    return tuple(out)
