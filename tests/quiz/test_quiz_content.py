"""The quiz's content: the answer key, both languages in step, explanations and sources."""

from __future__ import annotations

import re
import string

import pytest

from remat.quiz import LANGUAGES, default_language, load_quiz

KEY = "B,D,A,C,D,B,C,A"


@pytest.mark.parametrize("language", LANGUAGES)
def test_answer_key(language):
    quiz = load_quiz(language)
    assert len(quiz.questions) == 8
    assert quiz.answer_key == KEY
    assert [q.number for q in quiz.questions] == list(range(1, 9))


def test_right_answers_are_the_issue_s():
    quiz = load_quiz("en")
    right = [q.options[q.answer] for q in quiz.questions]
    assert right[0] == "Extra computation (FLOPs)"
    assert right[1] == "Because backpropagation needs them to compute gradients"
    assert right[2].startswith("Checkpoint placement, operators, and hardware")
    assert right[3] == "O(sqrt(N)) for activation storage"
    assert right[4].startswith("Recompute only the memory-heavy but computationally cheap")
    assert right[5] == "Offloading activations to CPU or NVMe"
    assert right[6] == "Backward recomputation should reproduce the intended forward randomness"
    assert right[7] == "Activation recomputation does not remove optimizer-state storage"


def test_both_languages_have_the_same_questions_options_and_keys():
    en, vi = load_quiz("en"), load_quiz("vi")
    assert [q.id for q in en.questions] == [q.id for q in vi.questions]
    assert [len(q.options) for q in en.questions] == [len(q.options) for q in vi.questions] == [4] * 8
    assert [q.answer for q in en.questions] == [q.answer for q in vi.questions]
    for q_en, q_vi in zip(en.questions, vi.questions):
        assert _fields(q_en.live_claim) == _fields(q_vi.live_claim), q_en.id
        assert q_en.prompt != q_vi.prompt and q_en.options != q_vi.options
    assert {k: _fields(v) for k, v in en.ui.items()} == {k: _fields(v) for k, v in vi.ui.items()}
    assert {k: _fields(v) for k, v in en.live_labels.items()} == {k: _fields(v) for k, v in vi.live_labels.items()}


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def test_vietnamese_is_vietnamese_and_keeps_the_seed_s_wording():
    vi = load_quiz("vi")
    assert vi.title == "Bài kiểm tra đánh đổi tính toán lại kích hoạt"
    assert vi.questions[0].prompt == "Việc tính toán lại kích hoạt sẽ đánh đổi điều gì để tiết kiệm bộ nhớ?"
    assert vi.questions[5].options[1] == "Giảm tải (offload) kích hoạt sang CPU hoặc NVMe"
    for q in vi.questions:
        assert any(ord(c) > 127 for c in q.prompt + q.explanation), q.id


@pytest.mark.parametrize("language", LANGUAGES)
def test_explanations_have_two_to_five_sentences(language):
    for q in load_quiz(language).questions:
        assert 2 <= _sentences(q.explanation) <= 5, (q.id, q.explanation)


def _sentences(text: str) -> int:
    # a sentence ends with . ! ? or : followed by a space and a capital; "et al." and "vs." do not end one
    ends = re.findall(r"(?<!\bal)(?<!\bvs)[.!?]\s+(?=[A-ZÀ-Ỹ])", text)
    return len(ends) + 1


@pytest.mark.parametrize("language", LANGUAGES)
def test_explanations_cite_their_sources(language):
    questions = {q.id: q for q in load_quiz(language).questions}
    assert "Chen" in questions["tradeoff"].explanation and "2016" in questions["tradeoff"].explanation
    assert "Chen" in questions["sqrt-n"].explanation
    assert "Griewank" in questions["sqrt-n"].explanation and "Revolve" in questions["sqrt-n"].explanation
    assert "Korthikanti" in questions["selective"].explanation
    assert "ZeRO" in questions["offload"].explanation
    assert "Rajbhandari" in questions["optimizer-state"].explanation


def test_unknown_language_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown quiz language 'fr'; allowed: en, vi"):
        load_quiz("fr")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"LANG": "vi_VN.UTF-8"}, "vi"),
        ({"LC_ALL": "vi_VN.UTF-8", "LANG": "en_US.UTF-8"}, "vi"),
        ({"LC_ALL": "C.UTF-8", "LANG": "vi_VN.UTF-8"}, "en"),
        ({"LANG": "de_DE.UTF-8"}, "en"),
        ({}, "en"),
    ],
)
def test_default_language_follows_the_locale(environ, expected):
    assert default_language(environ) == expected
