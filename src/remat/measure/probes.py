"""Probes that never crash the profile: a probe that raises marks its strategy unavailable.

The profile runs each block alone in several ways (plain, checkpointed, selectively
checkpointed) to price the strategies. Torch refuses some of them on some blocks (an output
written after it was cached, a replay that takes another branch than its forward); such a
failure says that the strategy cannot run on that block, not that the model cannot be
profiled. `Attempts` keeps the first failure of each strategy, as one line
(`failure_reason`), for `remat.measure.types.BlockProfile.unavailable`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Attempts", "failure_reason"]


def failure_reason(exc: BaseException, limit: int = 300) -> str:
    """``"<exception type>: <first line of its message>"``, at most ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Attempts:
    """Probes by strategy: the first that raises marks its strategy failed, with the reason,
    and the strategy's later probes are skipped."""

    def __init__(self, *, catch: bool = True) -> None:
        self._failed: dict[str, str] = {}
        self._catch = catch

    @classmethod
    def raising(cls) -> Attempts:
        """Attempts that let every failure through (a caller that wants the error itself)."""
        return cls(catch=False)

    def run(self, strategy: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None once a probe of ``strategy`` has raised."""
        if strategy in self._failed:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a probe's failure is reported, never raised
            if not self._catch:
                raise
            self._failed[strategy] = failure_reason(exc)
            return None

    def failed(self) -> dict[str, str]:
        """Strategy -> the reason its first failing probe gave."""
        return dict(self._failed)
