"""Shared test setup: the CLI renders as on a wide terminal, whatever runs the tests (rich
falls back to 80 columns without a terminal, which would wrap the tables the tests read); each
test traces the models it estimates itself (`remat.estimate.trace.clear_trace_cache`), whatever
ran before it in the same worker."""

import os
import sys

import pytest

os.environ["COLUMNS"] = "200"


@pytest.fixture(autouse=True)
def _own_traces():
    yield
    trace = sys.modules.get("remat.estimate.trace")
    if trace is not None:
        trace.clear_trace_cache()
