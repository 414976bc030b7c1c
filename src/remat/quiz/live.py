"""Live demonstrations: each quiz answer measured on this machine by remat's own stages.

Every demonstration builds a small built-in model, runs it through remat (profile, plan,
predict, apply, verify, offload) and returns a `Demonstration`: the numbers, and whether the
claim the answer makes holds here. Each takes well under 10 s on 2 CPU cores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, frozen=True)
class Demonstration:
    """What one live measurement found."""

    question_id: str
    """The question it backs (`remat.quiz.content.Question.id`)."""
    values: Mapping[str, Any]
    """The measured numbers (and short names) the question's ``live_claim`` template formats."""
    holds: bool
    """Whether the answer's claim holds in this measurement."""
    rows: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Label and formatted value per measured quantity, for a table."""


DEMONSTRATIONS: dict[str, Callable[[], Demonstration]] = {}
"""Question id -> the function that measures it."""


def demonstration(question_id: str) -> Callable[[Callable[[], Demonstration]], Callable[[], Demonstration]]:
    """Register a demonstration for the question ``question_id``."""

    def register(fn: Callable[[], Demonstration]) -> Callable[[], Demonstration]:
        DEMONSTRATIONS[question_id] = fn
        return fn

    return register


def demonstrate(question_id: str) -> Demonstration:
    """Run the live measurement for ``question_id``."""
    fn = DEMONSTRATIONS.get(question_id)
    if fn is None:
        raise LookupError(
            f"no live measurement for question {question_id!r}; available: {', '.join(sorted(DEMONSTRATIONS)) or 'none'}."
        )
    return fn()
