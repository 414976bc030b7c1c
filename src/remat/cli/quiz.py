"""``remat quiz``: the activation-recomputation quiz in the terminal (Vietnamese or English)."""

from __future__ import annotations

import json
import random
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat.cli._app import app, console, fail, styled
from remat.quiz.content import LANGUAGES, Question, Quiz, default_language, load_quiz
from remat.quiz.engine import GradedAnswer, QuizResult, grade, parse_answer, parse_answers, shuffle_quiz


def _say(*objects: object, **kwargs: object) -> None:
    # Prose, not data: no automatic colouring of numbers and brackets.
    console.print(*(styled(o) if isinstance(o, str) else o for o in objects), highlight=False, **kwargs)


@app.command("quiz")
def quiz_command(
    lang: Optional[str] = typer.Option(None, "--lang", help="vi or en (default: from LC_ALL/LANG, else en)."),
    shuffle: bool = typer.Option(False, "--shuffle", help="Shuffle each question's options."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for --shuffle (same seed, same order)."),
    answers: Optional[str] = typer.Option(None, "--answers", help="Grade these letters, one per question in order, e.g. A,A,A,A,A,A,A,A."),
    as_json: bool = typer.Option(False, "--json", help="With --answers or --list: print JSON."),
    list_only: bool = typer.Option(False, "--list", help="Print the questions and exit."),
    live: bool = typer.Option(False, "--live", help="After each explanation, measure the claim on this machine."),
) -> None:
    """Take the seed's quiz on activation recomputation; exit code 0 only if every answer is right."""
    quiz, seed = _prepare(lang, shuffle, seed, as_json and not (answers or list_only))
    if list_only:
        _print_list(quiz, as_json)
        return
    if answers is not None:
        result = _grade_given(quiz, answers, as_json, live, seed)
    else:
        result = _interactive(quiz, live, seed)
    raise typer.Exit(0 if result.all_right else 1)


def _prepare(lang: str | None, shuffle: bool, seed: int | None, json_alone: bool) -> tuple[Quiz, int | None]:
    if json_alone:
        raise fail("--json needs --answers or --list; for example: remat quiz --answers A,B,C,D,A,B,C,D --json.")
    if seed is not None and not shuffle:
        raise fail(f"--seed {seed} has no effect without --shuffle; add --shuffle or drop --seed.")
    language = default_language() if lang is None else lang
    if language not in LANGUAGES:
        raise fail(f"--lang {lang!r} is not available; allowed: {', '.join(LANGUAGES)}.")
    quiz = load_quiz(language)
    if not shuffle:
        return quiz, None
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    return shuffle_quiz(quiz, seed), seed


def _print_list(quiz: Quiz, as_json: bool) -> None:
    if as_json:
        items = [{"number": q.number, "id": q.id, "prompt": q.prompt, "options": list(q.options)} for q in quiz.questions]
        _print_json({"language": quiz.language, "title": quiz.title, "questions": items})
        return
    _say(f"[bold]{escape(quiz.title)}[/]\n")
    for q in quiz.questions:
        _print_question(quiz, q)


def _print_json(doc: dict) -> None:
    # console.out: no markup, no highlighting, no wrapping, so the output parses as JSON.
    console.out(json.dumps(doc, ensure_ascii=False, indent=2), highlight=False)


def _print_question(quiz: Quiz, q: Question) -> None:
    _say(f"[bold]{q.number}. {escape(q.prompt)}[/]")
    for letter, option in zip(q.letters, q.options):
        _say(f"   {letter}. {escape(option)}")
    _say()


def _grade_given(quiz: Quiz, answers: str, as_json: bool, live: bool, seed: int | None) -> QuizResult:
    result = grade(quiz, parse_answers(answers, quiz))
    if as_json:
        doc = result.to_dict()
        doc["seed"] = seed
        if live:
            doc["live"] = {q.id: _live_dict(quiz, q) for q in quiz.questions}
        _print_json(doc)
        return result
    for g in result.graded:
        _print_question(quiz, g.question)
        _print_feedback(quiz, g, live)
    _print_score(quiz, result)
    return result


def _interactive(quiz: Quiz, live: bool, seed: int | None) -> QuizResult:
    _say(f"[bold]{escape(quiz.title)}[/]\n{escape(quiz.intro)}")
    if seed is not None:
        _say(f"[dim]{escape(quiz.text('shuffled', seed=seed))}[/]")
    _say()
    chosen: list[int] = []
    try:
        for q in quiz.questions:
            _say(f"[dim]{escape(quiz.text('question', number=q.number, total=len(quiz.questions)))}[/]")
            _print_question(quiz, q)
            chosen.append(_ask(quiz, q))
            _print_feedback(quiz, GradedAnswer(question=q, chosen=chosen[-1]), live)
    except (EOFError, KeyboardInterrupt):
        _say()
        _say(escape(quiz.text("stopped", answered=len(chosen), total=len(quiz.questions))))
    result = grade(quiz, chosen)
    _print_score(quiz, result)
    return result


def _ask(quiz: Quiz, q: Question) -> int:
    last = q.letters[-1]
    while True:
        index = parse_answer(console.input(Text(quiz.text("prompt", last=last))), q)
        if index is not None:
            return index
        _say(f"[yellow]{escape(quiz.text('invalid', last=last))}[/]")


def _print_feedback(quiz: Quiz, g: GradedAnswer, live: bool) -> None:
    q = g.question
    if g.right:
        _say(f"[bold green]{escape(quiz.text('right'))}[/]")
    else:
        chosen = g.chosen_letter or quiz.text("unanswered")
        _say(f"[bold red]{escape(quiz.text('wrong', chosen=chosen))}[/]")
    _say(escape(quiz.text("right_answer", letter=q.answer_letter, text=q.options[q.answer])))
    _say(f"[italic]{escape(q.explanation)}[/]\n")
    if live:
        _print_live(quiz, q)


def _print_score(quiz: Quiz, result: QuizResult) -> None:
    style = "bold green" if result.all_right else "bold"
    _say(f"[{style}]{escape(quiz.text('score', score=result.score, total=result.total))}[/]")


def _run_live(q: Question):
    """The demonstration for ``q``, or the reason there is none (a missing stage, a failed run).

    A failed measurement is reported and the quiz goes on: the answers do not depend on it."""
    try:
        from remat.quiz.live import demonstrate

        return demonstrate(q.id), None
    except Exception as err:  # noqa: BLE001 - any failure of an optional measurement is shown, not fatal
        return None, f"{type(err).__name__}: {err}"


def _print_live(quiz: Quiz, q: Question) -> None:
    with console.status(escape(quiz.text("live")) + "..."):
        demo, reason = _run_live(q)
    if demo is None:
        _say(f"[yellow]{escape(quiz.text('live_unavailable', reason=reason))}[/]\n")
        return
    table = Table(title=quiz.text("live"), title_justify="left", show_header=False)
    for row in demo.rows:
        table.add_row(escape(quiz.label(row.label, **row.fields)), escape(row.value))
    _say(table)
    verdict = quiz.text("live_holds") if demo.holds else quiz.text("live_fails")
    colour = "green" if demo.holds else "red"
    _say(f"{escape(q.live_claim.format(**demo.values))} [{colour}]({escape(verdict)})[/]\n")


def _live_dict(quiz: Quiz, q: Question) -> dict:
    demo, reason = _run_live(q)
    if demo is None:
        return {"available": False, "reason": reason}
    return {
        "available": True,
        "holds": demo.holds,
        "claim": q.live_claim.format(**demo.values),
        "values": dict(demo.values),
    }
