"""Taking the quiz as data: shuffle options with a seed, read answers, grade, score.

Nothing here reads a terminal: the CLI asks the questions and renders the `QuizResult`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from remat.quiz.content import Question, Quiz


@dataclass(kw_only=True, frozen=True)
class GradedAnswer:
    """One question's outcome."""

    question: Question
    chosen: int | None
    """Index of the chosen option, None when the quiz ended before this question."""

    @property
    def answered(self) -> bool:
        return self.chosen is not None

    @property
    def right(self) -> bool:
        return self.chosen == self.question.answer

    @property
    def chosen_letter(self) -> str | None:
        return None if self.chosen is None else self.question.letters[self.chosen]


@dataclass(kw_only=True, frozen=True)
class QuizResult:
    """The graded quiz."""

    language: str
    graded: tuple[GradedAnswer, ...]

    @property
    def score(self) -> int:
        """Number of right answers."""
        return sum(g.right for g in self.graded)

    @property
    def total(self) -> int:
        return len(self.graded)

    @property
    def num_answered(self) -> int:
        return sum(g.answered for g in self.graded)

    @property
    def all_right(self) -> bool:
        return self.score == self.total

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: score, total, all_right and one entry per question."""
        return {
            "language": self.language,
            "score": self.score,
            "total": self.total,
            "answered": self.num_answered,
            "all_right": self.all_right,
            "questions": [_graded_dict(g) for g in self.graded],
        }


def _graded_dict(g: GradedAnswer) -> dict[str, Any]:
    q = g.question
    return {
        "number": q.number,
        "id": q.id,
        "chosen": g.chosen_letter,
        "answer": q.answer_letter,
        "right": g.right,
        "answer_text": q.options[q.answer],
    }


def shuffle_quiz(quiz: Quiz, seed: int) -> Quiz:
    """The quiz with each question's options in an order drawn from ``seed`` (same seed, same order)."""
    rng = random.Random(seed)
    return replace(quiz, questions=tuple(_shuffle_question(q, rng) for q in quiz.questions))


def _shuffle_question(question: Question, rng: random.Random) -> Question:
    order = list(range(len(question.options)))
    rng.shuffle(order)
    return replace(
        question,
        options=tuple(question.options[i] for i in order),
        answer=order.index(question.answer),
        source_order=tuple(order),
    )


def parse_answer(text: str, question: Question) -> int | None:
    """The option index for a typed letter (``"b"``, ``" B "``), or None if it names no option."""
    letter = text.strip().upper()
    if len(letter) != 1 or letter not in question.letters:
        return None
    return question.letters.index(letter)


def parse_answers(text: str, quiz: Quiz) -> tuple[int, ...]:
    """Option indices from ``"B,D,A,..."``: one letter per question, in order."""
    parts = [p for p in text.replace(" ", "").split(",")]
    if len(parts) != len(quiz.questions):
        raise ValueError(
            f"--answers has {len(parts)} entries ({text!r}) but the quiz has {len(quiz.questions)} "
            f"questions; give one letter per question, comma-separated, e.g. {_example(quiz)}."
        )
    indices = []
    for part, question in zip(parts, quiz.questions):
        index = parse_answer(part, question)
        if index is None:
            raise ValueError(
                f"--answers entry {question.number} is {part!r}; allowed: one of "
                f"{', '.join(question.letters)}, e.g. {_example(quiz)}."
            )
        indices.append(index)
    return tuple(indices)


def _example(quiz: Quiz) -> str:
    return ",".join("A" for _ in quiz.questions)


def grade(quiz: Quiz, answers: Sequence[int | None]) -> QuizResult:
    """Grade option indices (None or missing trailing entries: unanswered) against the key."""
    if len(answers) > len(quiz.questions):
        raise ValueError(f"{len(answers)} answers for a quiz of {len(quiz.questions)} questions; give at most one per question.")
    padded = list(answers) + [None] * (len(quiz.questions) - len(answers))
    for a, q in zip(padded, quiz.questions):
        if a is not None and not 0 <= a < len(q.options):
            raise ValueError(
                f"answer index {a} for question {q.number} is outside its options 0..{len(q.options) - 1}."
            )
    graded = tuple(GradedAnswer(question=q, chosen=a) for q, a in zip(quiz.questions, padded))
    return QuizResult(language=quiz.language, graded=graded)
