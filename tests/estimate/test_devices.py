"""Device table: every built-in value has a source; user files in JSON and TOML."""

from __future__ import annotations

import json

import pytest

from remat.estimate.devices import DeviceSpec, builtin_devices, load_devices_file, resolve_devices

GIB = 2**30


DEVICES = ["H100-80GB", "H200-141GB", "A100-40GB", "A100-80GB", "L4-24GB", "RTX4090-24GB", "B200-180GB", "GB200-186GB",
           "MI300X-192GB", "MI325X-256GB", "H100-PCIe-80GB", "H800-80GB", "L40S-48GB", "A10G-24GB"]
SOURCED = ("memory_bytes", "peak_bf16_flops_per_s", "peak_fp32_flops_per_s", "memory_bytes_per_s", "host_link_bytes_per_s",
           "gpu_link_bytes_per_s", "gpus_per_node", "network_bytes_per_s")


def test_builtin_table_has_every_device_with_a_source_per_value() -> None:
    table = builtin_devices()
    assert list(table) == DEVICES
    for spec in table.values():
        given = {k for k in SOURCED if getattr(spec, k) is not None}
        assert set(spec.sources) == given, spec.name
        assert {"memory_bytes", "peak_bf16_flops_per_s", "peak_fp32_flops_per_s", "memory_bytes_per_s",
                "host_link_bytes_per_s", "gpu_link_bytes_per_s"} <= given
        assert all(text.strip() for text in spec.sources.values())
    assert table["H100-80GB"].memory_bytes == 80 * GIB
    assert table["H100-80GB"].peak_bf16_flops_per_s == 989.4e12
    assert table["H100-80GB"].gpu_link_bytes_per_s == 450e9 and table["H100-80GB"].gpus_per_node == 8
    assert table["A100-40GB"].peak_bf16_flops_per_s == 312e12
    assert (table["H100-80GB"].peak_fp32_flops_per_s, table["H200-141GB"].peak_fp32_flops_per_s,
            table["A100-40GB"].peak_fp32_flops_per_s, table["MI300X-192GB"].peak_fp32_flops_per_s) == (67e12, 67e12, 19.5e12, 163.4e12)
    assert table["L4-24GB"].memory_bytes_per_s == 300e9
    assert table["B200-180GB"].peak_bf16_flops_per_s == 2.25e15 and table["GB200-186GB"].gpus_per_node == 72
    assert table["MI300X-192GB"].memory_bytes == 192 * GIB and table["MI325X-256GB"].memory_bytes_per_s == 6e12
    assert table["H800-80GB"].gpu_link_bytes_per_s == 160e9 and table["H800-80GB"].network_bytes_per_s == 50e9


def test_user_devices_json_and_toml(tmp_path) -> None:
    (tmp_path / "d.toml").write_text(
        '[[devices]]\nname = "Toy-1GB"\nmemory_bytes = 1073741824\npeak_bf16_flops_per_s = 1e12\n'
        'gpu_link_bytes_per_s = 5e10\ngpus_per_node = 4\n'
    )
    (tmp_path / "d.json").write_text(json.dumps({"devices": [
        {"name": "H100-80GB", "memory_bytes": 1000, "peak_bf16_flops_per_s": 5.0}]}))
    assert load_devices_file(tmp_path / "d.toml")["Toy-1GB"] == DeviceSpec(
        name="Toy-1GB", memory_bytes=GIB, peak_bf16_flops_per_s=1e12, gpu_link_bytes_per_s=5e10, gpus_per_node=4)
    specs = resolve_devices(["toy-1gb", "H100-80GB"], tmp_path / "d.toml")
    assert [s.memory_bytes for s in specs] == [GIB, 80 * GIB]
    assert resolve_devices(["H100-80GB"], tmp_path / "d.json")[0].memory_bytes == 1000  # the user's file wins


def test_bad_device_input(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown device 'B300'; known: H100-80GB, H200-141GB"):
        resolve_devices(["B300"])
    (tmp_path / "bad.toml").write_text('[[devices]]\nname = "X"\nmemory = 3\n')
    with pytest.raises(ValueError, match=r"missing \['memory_bytes', 'peak_bf16_flops_per_s'\], unknown \['memory'\]"):
        load_devices_file(tmp_path / "bad.toml")
    (tmp_path / "d.yaml").write_text("")
    with pytest.raises(ValueError, match="must end in .json or .toml"):
        load_devices_file(tmp_path / "d.yaml")
    with pytest.raises(ValueError, match="must both be positive"):
        DeviceSpec(name="z", memory_bytes=0, peak_bf16_flops_per_s=1.0)
