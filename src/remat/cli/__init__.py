"""The `remat` command line: commands only, no logic (each command calls the library)."""

from __future__ import annotations

import importlib

from remat.cli._app import app, main

# Each module registers its commands on `app` when imported.
_COMMAND_MODULES = ("profile", "plan", "run", "demo", "estimate", "quiz", "report")

for _name in _COMMAND_MODULES:
    importlib.import_module(f"remat.cli.{_name}")

__all__ = ["app", "main"]

