"""Fresh host memory: page faults are counted, and faulting a byte in has a measured cost."""

import mmap
import sys

import pytest
import torch

from remat.measure.faults import PROBE_BYTES, FaultCount, fault_bytes, first_touch_ms_per_byte


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by getrusage on Linux")
def _touch(region: mmap.mmap) -> None:
    """Write one byte of every page."""
    for offset in range(0, len(region), mmap.PAGESIZE):
        region[offset] = 1


def test_touching_fresh_memory_is_counted():
    # an anonymous mapping of its own is fresh by construction; a large tensor usually is too,
    # but the allocator may hand back pages it kept (a clean run's 64 MiB tensor faulted nothing once)
    region = mmap.mmap(-1, PROBE_BYTES)
    before = fault_bytes()
    _touch(region)
    after = fault_bytes()
    assert after - before >= PROBE_BYTES // 2  # huge pages may fold some faults together
    _touch(region)  # touched already: (almost) nothing new
    assert fault_bytes() - after < PROBE_BYTES // 8
    region.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by getrusage on Linux")
def test_first_touch_cost_is_positive_on_the_cpu_and_zero_elsewhere():
    # one probe on a loaded machine can read 0 (its pages came back without faulting); of three,
    # one reads the cost (the suite failed on a single probe in a clean clone, 2026-12-05)
    assert max(first_touch_ms_per_byte(torch.device("cpu")) for _ in range(3)) > 0.0
    assert first_touch_ms_per_byte(torch.device("meta")) == 0.0
    assert first_touch_ms_per_byte(torch.device("cuda")) == 0.0  # a caching allocator: nothing faults in a steady state


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by getrusage on Linux")
def test_fault_count_around_a_region():
    region = mmap.mmap(-1, PROBE_BYTES)
    with FaultCount() as counted:
        _touch(region)
    region.close()
    assert counted.bytes >= PROBE_BYTES // 2
    with FaultCount(enabled=False) as off:
        torch.empty(PROBE_BYTES // 4).fill_(1.0)
    assert off.bytes is None
