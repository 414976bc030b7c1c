"""``remat quiz``: non-interactive grading and listing, and the interactive flow in a pseudo-terminal."""

from __future__ import annotations

import json
import os
import signal

import pexpect
import pytest

from remat.quiz import load_quiz, shuffle_quiz

KEY = "B,D,A,C,D,B,C,A"


def test_answers_json_all_right_exits_0(invoke):
    result = invoke("quiz", "--answers", KEY, "--json", "--lang", "en")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["score"], doc["total"], doc["all_right"], doc["seed"]) == (8, 8, True, None)
    assert [q["chosen"] for q in doc["questions"]] == KEY.split(",")


def test_one_wrong_answer_exits_1(invoke):
    result = invoke("quiz", "--answers", "B,D,A,C,D,B,C,B", "--json", "--lang", "vi")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["score"] == 7 and doc["language"] == "vi"
    assert doc["questions"][7]["right"] is False and doc["questions"][7]["answer"] == "A"


def test_answers_text_shows_verdicts_explanations_and_score(invoke):
    result = invoke("quiz", "--answers", "A,D,A,C,D,B,C,A", "--lang", "en", env={"COLUMNS": "400"})
    assert result.exit_code == 1
    out = result.stdout
    assert "Wrong: you chose A." in out and out.count("Right.") == 7
    assert "The right answer is B: Extra computation (FLOPs)" in out
    assert "Chen et al. 2016" in out and "Score: 7/8" in out


def test_invalid_answers_are_a_clear_error(invoke):
    result = invoke("quiz", "--answers", "B,D,A,C,D,B,C,X")
    assert result.exit_code == 2
    assert "--answers entry 8 is 'X'; allowed: one of A, B, C, D" in " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--seed", "3"), "--seed 3 has no effect without --shuffle"),
        (("--json",), "--json needs --answers or --list"),
        (("--lang", "fr", "--list"), "--lang 'fr' is not available; allowed: en, vi"),
    ],
)
def test_bad_options_are_clear_errors(invoke, args, message):
    result = invoke("quiz", *args)
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_shuffle_with_seed_grades_the_displayed_letters(invoke):
    key = shuffle_quiz(load_quiz("en"), seed=11).answer_key
    assert key != KEY
    result = invoke("quiz", "--shuffle", "--seed", "11", "--answers", key, "--json", "--lang", "en")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["seed"] == 11


def test_list_prints_every_question_and_option(invoke):
    result = invoke("quiz", "--list", "--lang", "vi", env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for q in load_quiz("vi").questions:
        assert f"{q.number}. {q.prompt}" in result.stdout
        assert f"D. {q.options[3]}" in result.stdout
    listed = json.loads(invoke("quiz", "--list", "--json", "--lang", "en").stdout)
    assert [len(q["options"]) for q in listed["questions"]] == [4] * 8


def test_language_defaults_from_the_locale(invoke):
    result = invoke("quiz", "--list", "--json", env={"LC_ALL": "", "LC_MESSAGES": "", "LANG": "vi_VN.UTF-8"})
    assert json.loads(result.stdout)["language"] == "vi"


def _spawn(remat_argv, *args: str, lang: str = "en_US.UTF-8", colour: bool = False) -> pexpect.spawn:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "NO_COLOR"}
    env.update(LANG=lang, COLUMNS="300")
    if colour:
        env["TERM"] = "xterm-256color"
    else:
        env.update(TERM="dumb", NO_COLOR="1")
    argv = remat_argv("quiz", *args)
    # Started as a terminal's shell starts a foreground job: Ctrl-C interrupts it. A runner that
    # starts the tests in the background passes SIGINT down ignored, and Python then keeps it so.
    return pexpect.spawn(
        argv[0], argv[1:], env=env, encoding="utf-8", timeout=60, dimensions=(50, 300), preexec_fn=_default_sigint
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interactive_reprompts_grades_and_ends_cleanly_on_eof(remat_argv):
    child = _spawn(remat_argv)
    child.expect_exact("Question 1 of 8")
    child.expect_exact("Your answer (A-D): ")
    child.sendline("b")
    child.expect_exact("Right.")
    child.expect_exact("Question 2 of 8")
    child.expect_exact("Your answer (A-D): ")
    child.sendline("z")
    child.expect_exact("Please type one of the letters A-D.")
    child.expect_exact("Your answer (A-D): ")
    child.sendline("A")
    child.expect_exact("Wrong: you chose A.")
    child.expect_exact("The right answer is D: Because backpropagation needs them to compute gradients")
    child.expect_exact("Your answer (A-D): ")
    child.sendeof()
    child.expect_exact("Quiz stopped after 2 of 8 questions.")
    child.expect_exact("Score: 1/8")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1


def test_interactive_vietnamese_all_right_exits_0(remat_argv):
    # a colour terminal: the prompt and the verdicts must still read as plain text
    child = _spawn(remat_argv, lang="vi_VN.UTF-8", colour=True)
    child.expect_exact("Bài kiểm tra đánh đổi tính toán lại kích hoạt")
    for letter in KEY.split(","):
        child.expect_exact("Câu trả lời của bạn (A-D): ")
        child.sendline(letter)
        child.expect_exact("Đúng.")
    child.expect_exact("Điểm: 8/8")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_interactive_ctrl_c_ends_with_the_score_so_far(remat_argv):
    child = _spawn(remat_argv, "--lang", "en", "--shuffle", "--seed", "11")
    child.expect_exact("Options shuffled; --shuffle --seed 11 gives this order again.")
    child.expect_exact("Your answer (A-D): ")
    child.sendline(shuffle_quiz(load_quiz("en"), seed=11).questions[0].answer_letter)
    child.expect_exact("Right.")
    child.expect_exact("Your answer (A-D): ")
    child.sendintr()
    child.expect_exact("Quiz stopped after 1 of 8 questions.")
    child.expect_exact("Score: 1/8")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1


def test_a_failed_live_measurement_is_reported_and_the_quiz_goes_on(invoke, monkeypatch):
    def broken():
        raise RuntimeError("disk full while offloading blocks.0")

    monkeypatch.setattr("remat.quiz.live.DEMONSTRATIONS", {"tradeoff": broken})
    result = invoke("quiz", "--answers", KEY, "--live", "--lang", "en", env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "No live measurement for this question: RuntimeError: disk full while offloading blocks.0" in result.stdout
    assert "No live measurement for this question: LookupError: no live measurement for question 'why-saved'" in result.stdout
    assert "Score: 8/8" in result.stdout
    doc = json.loads(invoke("quiz", "--answers", KEY, "--json", "--live").stdout)
    assert doc["live"]["tradeoff"] == {"available": False, "reason": "RuntimeError: disk full while offloading blocks.0"}
