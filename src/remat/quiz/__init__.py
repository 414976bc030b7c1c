"""The seed's quiz on the activation-recomputation trade-off, in Vietnamese and English.

`content` loads the questions, `engine` shuffles, reads and grades answers, `live` backs each
answer with a measurement taken by remat's own stages; the ``remat quiz`` command asks and renders.
"""

from remat.quiz.content import LANGUAGES, Question, Quiz, default_language, load_quiz
from remat.quiz.engine import GradedAnswer, QuizResult, grade, parse_answer, parse_answers, shuffle_quiz

__all__ = [
    "LANGUAGES",
    "GradedAnswer",
    "Question",
    "Quiz",
    "QuizResult",
    "default_language",
    "grade",
    "load_quiz",
    "parse_answer",
    "parse_answers",
    "shuffle_quiz",
]
