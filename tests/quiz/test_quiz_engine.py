"""Shuffling, reading and grading answers: data in, data out."""

from __future__ import annotations

import json

import pytest

from remat.quiz import grade, load_quiz, parse_answer, parse_answers, shuffle_quiz

KEY = "B,D,A,C,D,B,C,A"


def test_shuffle_is_reproducible_and_keeps_the_right_answer():
    quiz = load_quiz("en")
    a, b = shuffle_quiz(quiz, seed=7), shuffle_quiz(quiz, seed=7)
    assert a == b
    for original, shuffled in zip(quiz.questions, a.questions):
        assert sorted(shuffled.source_order) == [0, 1, 2, 3]
        assert sorted(shuffled.options) == sorted(original.options)
        assert shuffled.options[shuffled.answer] == original.options[original.answer]
        assert [original.options[i] for i in shuffled.source_order] == list(shuffled.options)


def test_different_seeds_give_different_orders():
    quiz = load_quiz("vi")
    orders = {tuple(q.source_order for q in shuffle_quiz(quiz, seed=s).questions) for s in range(5)}
    assert len(orders) == 5
    assert all(q.source_order == () for q in quiz.questions)


def test_parse_answer_accepts_letters_in_any_case_and_rejects_the_rest():
    question = load_quiz("en").questions[0]
    assert [parse_answer(t, question) for t in ("a", " B ", "c\n", "D")] == [0, 1, 2, 3]
    assert [parse_answer(t, question) for t in ("", "E", "AB", "1", "b)")] == [None] * 5


def test_parse_answers():
    quiz = load_quiz("en")
    assert parse_answers("b, d,a,C,D,B,C,A", quiz) == (1, 3, 0, 2, 3, 1, 2, 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("B,D,A", r"--answers has 3 entries \('B,D,A'\) but the quiz has 8 questions"),
        ("B,D,A,C,D,B,C,E", r"--answers entry 8 is 'E'; allowed: one of A, B, C, D"),
        ("B,D,,C,D,B,C,A", r"--answers entry 3 is ''; allowed: one of A, B, C, D"),
    ],
)
def test_bad_answers_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_answers(text, load_quiz("en"))


def test_grade_all_right():
    quiz = load_quiz("en")
    result = grade(quiz, parse_answers(KEY, quiz))
    assert (result.score, result.total, result.num_answered, result.all_right) == (8, 8, 8, True)


def test_grade_counts_wrong_and_unanswered():
    quiz = load_quiz("vi")
    result = grade(quiz, [1, 0, 0])
    assert (result.score, result.total, result.num_answered, result.all_right) == (2, 8, 3, False)
    assert [g.right for g in result.graded[:3]] == [True, False, True]
    assert result.graded[1].chosen_letter == "A" and result.graded[5].chosen_letter is None
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["score"] == 2 and doc["answered"] == 3 and doc["language"] == "vi"
    assert doc["questions"][1] == {
        "number": 2,
        "id": "why-saved",
        "chosen": "A",
        "answer": "D",
        "right": False,
        "answer_text": "Bởi vì lan truyền ngược cần chúng để tính toán gradient",
    }


def test_grade_rejects_out_of_range_answers():
    quiz = load_quiz("en")
    with pytest.raises(ValueError, match=r"answer index 4 for question 1 is outside its options 0..3"):
        grade(quiz, [4])
    with pytest.raises(ValueError, match=r"9 answers for a quiz of 8 questions"):
        grade(quiz, [0] * 9)


def test_shuffled_key_grades_all_right():
    quiz = shuffle_quiz(load_quiz("en"), seed=3)
    assert grade(quiz, parse_answers(quiz.answer_key, quiz)).all_right
    assert not grade(quiz, parse_answers(KEY, quiz)).all_right
