"""Fresh host memory: page faults are counted, and faulting a byte in has a measured cost."""

import sys

import pytest
import torch

from remat.measure.faults import PROBE_BYTES, FaultCount, fault_bytes, first_touch_ms_per_byte


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by getrusage on Linux")
def test_touching_fresh_memory_is_counted():
    before = fault_bytes()
    buffer = torch.empty(PROBE_BYTES // 4)  # mapped on its own: no page is touched yet
    buffer.fill_(1.0)
    after = fault_bytes()
    assert after - before >= PROBE_BYTES // 2  # huge pages may fold some faults together
    buffer.fill_(2.0)  # touched already: (almost) nothing new
    assert fault_bytes() - after < PROBE_BYTES // 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by getrusage on Linux")
def test_first_touch_cost_is_positive_on_the_cpu_and_zero_elsewhere():
    assert first_touch_ms_per_byte(torch.device("cpu")) > 0.0
    assert first_touch_ms_per_byte(torch.device("meta")) == 0.0
    assert first_touch_ms_per_byte(torch.device("cuda")) == 0.0  # a caching allocator: nothing faults in a steady state


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by getrusage on Linux")
def test_fault_count_around_a_region():
    with FaultCount() as counted:
        torch.empty(PROBE_BYTES // 4).fill_(1.0)
    assert counted.bytes >= PROBE_BYTES // 2
    with FaultCount(enabled=False) as off:
        torch.empty(PROBE_BYTES // 4).fill_(1.0)
    assert off.bytes is None
