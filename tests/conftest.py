"""Shared test setup: the CLI renders as on a wide terminal, whatever runs the tests (rich
falls back to 80 columns without a terminal, which would wrap the tables the tests read)."""

import os

os.environ["COLUMNS"] = "200"
