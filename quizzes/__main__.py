"""`python -m quizzes take 01 [--answers B,AC,6144,...]` and `python -m quizzes check [FILES]`.

`check` validates each quiz (schema, semantic rules, the keyed option strictly longest in at
most half of a quiz's single-choice questions); with no FILES it checks every lesson's quiz
and the course-wide balance: keyed option strictly longest in at most 30% of single-choice
questions, no answer letter holding more than 35% of the keys."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quizzes import (
    LETTERS,
    QuizError,
    balance_stats,
    course_balance_errors,
    feedback,
    find_quiz,
    is_correct,
    load_quiz,
    parse_answer,
    problems_in,
    quiz_paths,
)


def show_question(number: int, total: int, question: dict) -> None:
    kind = {"single": "one answer", "multiple": "all that apply",
            "numeric": f"a number, in {question.get('unit', '')}"}[question["type"]]
    print(f"\nQuestion {number}/{total} [{question['stage']}, {question['section']}] ({kind})")
    print(question["prompt"])
    for letter, option in zip(LETTERS, question.get("options", [])):
        print(f"  {letter}) {option['text']}")


def take(key: str, answers: str | None) -> int:
    try:
        quiz = load_quiz(find_quiz(key))
    except QuizError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    questions = quiz["questions"]
    scripted = None
    if answers is not None:
        scripted = [token.strip() for token in answers.split(",")]
        if len(scripted) > len(questions):
            print(f"error: {len(scripted)} answers for {len(questions)} questions",
                  file=sys.stderr)
            return 2
    print(f"{quiz['title']} ({len(questions)} questions)")
    score = answered = 0
    for number, question in enumerate(questions, 1):
        if scripted is not None and number > len(scripted):
            break
        show_question(number, len(questions), question)
        while True:
            if scripted is not None:
                text = scripted[number - 1]
                print(f"> {text}")
            else:
                try:
                    text = input("> ")
                except EOFError:
                    print("\n(end of input)")
                    return report(score, answered, len(questions))
            try:
                answer = parse_answer(question, text)
                break
            except ValueError as exc:
                if scripted is not None:
                    print(f"error: question {number}: {exc}", file=sys.stderr)
                    return 2
                print(f"  {exc}; try again")
        answered += 1
        score += is_correct(question, answer)
        print("\n".join(feedback(question, answer)))
    return report(score, answered, len(questions))


def report(score: int, answered: int, total: int) -> int:
    if answered < total:
        print(f"\nScore: {score}/{answered} answered ({total - answered} not answered)")
    else:
        print(f"\nScore: {score}/{total}")
    return 0


def check(files: list[Path]) -> int:
    paths = files or quiz_paths()
    if not paths:
        print("error: no quiz files found", file=sys.stderr)
        return 1
    problems = [problem for path in paths for problem in problems_in(path)]
    if not files:  # the whole course: the course-wide balance rules too
        quizzes = {str(path): json.loads(path.read_text()) for path in paths}
        problems += course_balance_errors(quizzes)
        stats = balance_stats(list(quizzes.values()))
        print(f"course: correct option longest in {stats['longest_keyed']} of {stats['single']} "
              f"single-choice questions; keys by position "
              + ", ".join(f"{k} {v}" for k, v in stats["positions"].items()))
    for problem in problems:
        print(problem)
    print(f"{len(paths)} quiz file(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quizzes", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    take_parser = sub.add_parser("take", help="take a lesson's quiz in the terminal")
    take_parser.add_argument("lesson", help="lesson id (01), folder or slug")
    take_parser.add_argument("--answers", help="comma-separated answers, one per question "
                                               "(letters, or a number): non-interactive")
    check_parser = sub.add_parser("check", help="validate quizzes against quizzes/schema.json")
    check_parser.add_argument("files", nargs="*", type=Path, help="default: every lesson's quiz")
    args = parser.parse_args(argv)
    if args.command == "take":
        return take(args.lesson, args.answers)
    return check(args.files)


if __name__ == "__main__":
    sys.exit(main())
