"""The quiz's content: eight questions in Vietnamese and English, loaded from the package data.

The text lives in ``data/<lang>.json`` (one file per language, same questions, same option
order, same answer key); this module only loads and validates it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

LANGUAGES = ("en", "vi")
"""Languages the quiz ships in."""
QUIZ_FORMAT = "remat-quiz"
QUIZ_VERSION = 1
LETTERS = "ABCDEFGH"


@dataclass(kw_only=True, frozen=True)
class Question:
    """One multiple-choice question in one language."""

    number: int
    """1-based position in the quiz."""
    id: str
    """Language-independent name, e.g. ``"sqrt-n"``."""
    prompt: str
    """The question."""
    options: tuple[str, ...]
    """The options in display order (lettered A, B, C, D)."""
    answer: int
    """Index into ``options`` of the right one."""
    explanation: str
    """Why the answer is right, citing the source where one exists."""
    live_claim: str
    """Template (``str.format``) of the one-line claim a live measurement checks."""
    source_order: tuple[int, ...] = ()
    """For shuffled questions: the data-file index of each displayed option (empty: unshuffled)."""

    def __post_init__(self) -> None:
        if not 2 <= len(self.options) <= len(LETTERS):
            raise ValueError(
                f"question {self.id!r} has {len(self.options)} options; between 2 and {len(LETTERS)} are allowed."
            )
        if not 0 <= self.answer < len(self.options):
            raise ValueError(
                f"question {self.id!r} answer index {self.answer} is outside its {len(self.options)} options."
            )

    @property
    def letters(self) -> str:
        """The letters of the options, e.g. ``"ABCD"``."""
        return LETTERS[: len(self.options)]

    @property
    def answer_letter(self) -> str:
        return LETTERS[self.answer]


@dataclass(kw_only=True, frozen=True)
class Quiz:
    """All questions of the quiz in one language, plus the interface strings."""

    language: str
    """``"en"`` or ``"vi"``."""
    title: str
    intro: str
    ui: Mapping[str, str]
    """Interface strings (``str.format`` templates) by key: ``right``, ``wrong``, ``score``..."""
    questions: tuple[Question, ...]
    live_labels: Mapping[str, str] = field(default_factory=dict)
    """Labels of the live measurements' table lines (``str.format`` templates) by key."""

    @property
    def answer_key(self) -> str:
        """The right letters, comma-separated, one per question in order."""
        return ",".join(q.answer_letter for q in self.questions)

    def text(self, key: str, **values: Any) -> str:
        """The interface string ``key`` in this language, formatted with ``values``."""
        return self.ui[key].format(**values)

    def label(self, key: str, **fields: Any) -> str:
        """The live-table label ``key`` in this language; the key itself if the data lacks it."""
        return self.live_labels.get(key, key).format(**fields)


def load_quiz(language: str = "en") -> Quiz:
    """The quiz in ``language`` (``"en"`` or ``"vi"``)."""
    if language not in LANGUAGES:
        raise ValueError(
            f"unknown quiz language {language!r}; allowed: {', '.join(LANGUAGES)}. "
            "Pass --lang en or --lang vi."
        )
    text = resources.files("remat.quiz").joinpath("data", f"{language}.json").read_text(encoding="utf-8")
    return _quiz_from_document(json.loads(text), language)


def _quiz_from_document(doc: Mapping[str, Any], language: str) -> Quiz:
    if doc.get("format") != QUIZ_FORMAT or doc.get("version") != QUIZ_VERSION:
        raise ValueError(
            f"quiz data for {language!r} has format {doc.get('format')!r} version {doc.get('version')!r}; "
            f"expected {QUIZ_FORMAT!r} version {QUIZ_VERSION}. Reinstall remat."
        )
    questions = tuple(
        Question(
            number=i + 1,
            id=q["id"],
            prompt=q["prompt"],
            options=tuple(q["options"]),
            answer=LETTERS.index(q["answer"]),
            explanation=q["explanation"],
            live_claim=q["live_claim"],
        )
        for i, q in enumerate(doc["questions"])
    )
    return Quiz(language=language, title=doc["title"], intro=doc["intro"], ui=dict(doc["ui"]),
                questions=questions, live_labels=dict(doc.get("live_labels", {})))


def default_language(environ: Mapping[str, str] | None = None) -> str:
    """``"vi"`` when the locale (LC_ALL, then LC_MESSAGES, then LANG) starts with ``vi``, else ``"en"``."""
    env = os.environ if environ is None else environ
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = env.get(name, "")
        if value:
            return "vi" if value.lower().startswith("vi") else "en"
    return "en"
