"""The device check's sections: each under its own time limit, each in its own try/except, each
keeping what it measured before it ran out or failed.

A section is a function that fills a dict as it goes (a row per model, a part per comparison),
so a section stopped half-way still hands back its finished parts. Its status is one of:

- ``ok``: it ran to its end;
- ``skipped``: it does not apply here (it raised `Skipped`, whose message says why);
- ``timed out``: its limit passed (`SectionTimeout`, raised by SIGALRM in the main thread);
- ``failed``: it raised anything else; the message and the traceback's last frames are kept.

Time: the sections share one total limit. Each gets the time still left times its share of the
shares still to run, so time a section leaves unused passes on to the next ones, and the sum of
the limits never exceeds the total.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

Progress = Callable[[str], None]
STATUSES = ("ok", "skipped", "timed out", "failed")


class Skipped(Exception):
    """The section does not apply on this device or at this size; the message says why."""


class SectionTimeout(BaseException):
    """The section's time limit passed. A `BaseException`, like KeyboardInterrupt: the harnesses
    record a strategy that raises ``Exception`` and go on, and must not swallow the limit."""


class PartsFailed(Exception):
    """Some parts of a section failed; the others ran (`run_part`)."""


@dataclass(kw_only=True, frozen=True)
class Section:
    """One part of the device check."""

    name: str
    """Key in ``results.json`` and heading in ``results.md``."""
    share: float
    """Weight of the section in the total time limit."""
    run: Callable[[dict[str, Any], Progress], None]
    """``run(data, progress)``: fills ``data`` as it measures; raises `Skipped` when it does not apply."""


def limit_s(remaining_s: float, share: float, shares_left: float) -> float:
    """The time a section gets: its share of the shares still to run, of the time still left."""
    return max(0.0, remaining_s) * share / shares_left if shares_left > 0 else 0.0


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `SectionTimeout` in the code under the ``with`` after ``seconds``.

    SIGALRM interrupts Python code between bytecodes, so a long kernel or a CUDA synchronize
    finishes first. Signals reach only the main thread: elsewhere there is no limit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"the section's {seconds:.0f} s ran out")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _failure(exc: BaseException) -> str:
    frames = traceback.format_tb(exc.__traceback__)[-3:]
    return f"{type(exc).__name__}: {exc}\n" + "".join(frames)


def run_part(failures: dict[str, str], name: str, part: Callable[..., Any], *args: Any) -> Any:
    """``part(*args)``, one part of a section (a model, a mode); a failure is recorded under
    ``name`` (None is returned) and the section goes on with its next part (`raise_failures` at
    its end)."""
    try:
        return part(*args)
    except Exception as exc:  # the other parts of the section still run
        failures[name] = _failure(exc)
        return None


def prefixed(progress: Progress, prefix: str) -> Progress:
    """``progress`` with every message prefixed (``"gpt: verifying full"``)."""
    return lambda message: progress(f"{prefix}: {message}")


def raise_failures(failures: dict[str, str]) -> None:
    """Fail the section when any of its parts failed (their rows stay in its data)."""
    if failures:
        first = next(iter(failures.values())).splitlines()[0]
        raise PartsFailed(f"{len(failures)} part(s) failed: {', '.join(failures)} (first: {first})")


def _release_memory() -> None:
    """Free what a section left (an interrupted one too) before the next one measures."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_section(section: Section, seconds: float, progress: Progress) -> dict[str, Any]:
    """Run one section under ``seconds``; its result with whatever it measured."""
    data: dict[str, Any] = {}
    start = time.monotonic()
    status, note = "ok", ""
    progress(f"{section.name}: start (limit {seconds:.0f} s)")
    try:
        with time_limit(seconds):
            section.run(data, prefixed(progress, section.name))
    except Skipped as exc:
        status, note = "skipped", str(exc)
    except SectionTimeout as exc:
        status, note = "timed out", f"{exc}; what it finished before is kept"
    except Exception as exc:  # one section's failure must not lose the others
        status, note = "failed", _failure(exc)
    _release_memory()
    elapsed_s = time.monotonic() - start
    progress(f"{section.name}: {status} after {elapsed_s:.1f} s" + (f" ({note.splitlines()[0]})" if note else ""))
    return {"status": status, "note": note, "seconds": elapsed_s, "limit_s": seconds, "data": data}


def run_sections(sections: Sequence[Section], total_s: float, progress: Progress,
                 on_section: Callable[[dict[str, dict[str, Any]]], None]) -> dict[str, dict[str, Any]]:
    """Run every section in order within ``total_s``; ``on_section(results)`` after each (to
    write what there is so far: a run killed from outside keeps its finished sections)."""
    results: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + total_s
    for i, section in enumerate(sections):
        shares_left = sum(s.share for s in sections[i:])
        seconds = limit_s(deadline - time.monotonic(), section.share, shares_left)
        results[section.name] = run_section(section, seconds, progress)
        on_section(results)
    return results
