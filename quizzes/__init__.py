"""The quiz tool: load, validate and grade the lessons' JSON quizzes.

A quiz is `lessons/NN_slug/quiz.json`, validated by `quizzes/schema.json` (JSON Schema draft
2020-12) plus the rules JSON Schema cannot say (see `semantic_errors`). `python -m quizzes`
is the command line: `take 01` and `check`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import lru_cache
from pathlib import Path

from jsonschema import Draft202012Validator

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = Path(__file__).resolve().parent / "schema.json"
LETTERS = "ABCDEFGH"
MIN_NUMERIC = 2
# A learner must not score by picking the longest option or a favourite letter (COURSE.md):
MAX_LONGEST_KEYED_COURSE = 0.30  # keyed option strictly longest, share of single-choice, course
MAX_LONGEST_KEYED_LESSON = 0.50  # ... and within any one quiz
MAX_POSITION_SHARE = 0.35  # of single-choice keys on one letter, course-wide


class QuizError(ValueError):
    """A quiz file that cannot be used; the message names the file and the field."""


@dataclasses.dataclass
class Problem:
    file: str
    path: str  # JSON path, e.g. $.questions[3].options
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.path}: {self.message}"


@lru_cache(maxsize=1)
def validator() -> Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def quiz_paths() -> list[Path]:
    """Every lesson's quiz, in lesson order."""
    return sorted(REPO_ROOT.glob("lessons/[0-9][0-9]_*/quiz.json"))


def find_quiz(key: str) -> Path:
    """A quiz by lesson id ("01"), folder ("01_collectives") or slug ("collectives")."""
    for path in quiz_paths():
        folder = path.parent.name
        if key in (folder, folder[:2], folder[3:]):
            return path
    known = ", ".join(p.parent.name for p in quiz_paths()) or "none"
    raise QuizError(f"no quiz for lesson {key!r} (known: {known})")


def readme_sections(lesson_dir: Path) -> set[str]:
    """The '## ' headings of a lesson's README."""
    readme = lesson_dir / "README.md"
    if not readme.exists():
        return set()
    return {m.group(1).strip() for m in re.finditer(r"^## +(.+)$", readme.read_text(), re.M)}


def semantic_errors(quiz: dict, file: str, sections: set[str] | None = None) -> list[Problem]:
    """Rules beyond the schema: unique ids; a single-choice question has exactly one correct
    option and a multiple-choice one at least one; at least two numeric questions; correct
    answers not always in the same position; every section is a heading of the README."""
    problems = []
    questions = quiz.get("questions", [])
    seen: set[str] = set()
    positions = []
    for index, question in enumerate(questions):
        where = f"$.questions[{index}]"
        if question.get("id") in seen:
            problems.append(Problem(file, f"{where}.id", f"duplicate id {question['id']!r}"))
        seen.add(question.get("id"))
        options = question.get("options", [])
        correct = [i for i, option in enumerate(options) if option.get("correct")]
        if question.get("type") == "single":
            if len(correct) != 1:
                problems.append(Problem(file, f"{where}.options",
                                        f"single-choice needs exactly 1 correct option, has "
                                        f"{len(correct)}"))
            else:
                positions.append(correct[0])
        if question.get("type") == "multiple" and not correct:
            problems.append(Problem(file, f"{where}.options", "no correct option"))
        if sections is not None and question.get("section") not in sections:
            problems.append(Problem(file, f"{where}.section",
                                    f"{question.get('section')!r} is not a '## ' heading of "
                                    f"the lesson README"))
    numeric = sum(1 for q in questions if q.get("type") == "numeric")
    if numeric < MIN_NUMERIC:
        problems.append(Problem(file, "$.questions", f"{numeric} numeric questions, need at "
                                                     f"least {MIN_NUMERIC}"))
    if len(positions) >= 3 and len(set(positions)) == 1:
        problems.append(Problem(file, "$.questions", f"every single-choice answer is option "
                                                     f"{LETTERS[positions[0]]}: spread them"))
    return problems


def keyed_is_strictly_longest(question: dict) -> bool:
    """True when a single-choice question's correct option is longer than every wrong one."""
    options = question.get("options", [])
    keyed = [len(o["text"]) for o in options if o.get("correct")]
    others = [len(o["text"]) for o in options if not o.get("correct")]
    return len(keyed) == 1 and bool(others) and keyed[0] > max(others)


def balance_stats(quizzes: list[dict]) -> dict:
    """Over the single-choice questions of `quizzes`: how many there are, in how many the keyed
    option is strictly the longest, and how many keys sit at each position (A, B, ...)."""
    singles = [q for quiz in quizzes for q in quiz.get("questions", []) if q.get("type") == "single"]
    positions: dict[str, int] = {}
    for question in singles:
        for index, option in enumerate(question.get("options", [])):
            if option.get("correct"):
                positions[LETTERS[index]] = positions.get(LETTERS[index], 0) + 1
    return {"single": len(singles),
            "longest_keyed": sum(keyed_is_strictly_longest(q) for q in singles),
            "positions": dict(sorted(positions.items()))}


def balance_errors(quiz: dict, file: str) -> list[Problem]:
    """One quiz's balance rule: the keyed option is strictly the longest in at most half of
    its single-choice questions."""
    stats = balance_stats([quiz])
    if stats["single"] and stats["longest_keyed"] > MAX_LONGEST_KEYED_LESSON * stats["single"]:
        return [Problem(file, "$.questions", f"the correct option is the longest in "
                                             f"{stats['longest_keyed']} of {stats['single']} "
                                             f"single-choice questions (at most "
                                             f"{MAX_LONGEST_KEYED_LESSON:.0%}): make right and wrong "
                                             f"options alike in length")]
    return []


def course_balance_errors(quizzes: dict[str, dict]) -> list[Problem]:
    """Course-wide rules over every quiz (file name -> quiz): the keyed option is strictly the
    longest in at most 30% of single-choice questions, and no position holds more than 35% of
    the keys."""
    stats = balance_stats(list(quizzes.values()))
    problems = []
    if stats["single"] and stats["longest_keyed"] > MAX_LONGEST_KEYED_COURSE * stats["single"]:
        problems.append(Problem("course", "$", f"the correct option is the longest in "
                                               f"{stats['longest_keyed']} of {stats['single']} "
                                               f"single-choice questions (at most "
                                               f"{MAX_LONGEST_KEYED_COURSE:.0%})"))
    for letter, count in stats["positions"].items():
        if stats["single"] and count > MAX_POSITION_SHARE * stats["single"]:
            problems.append(Problem("course", "$", f"option {letter} is the answer of {count} of "
                                                   f"{stats['single']} single-choice questions "
                                                   f"(at most {MAX_POSITION_SHARE:.0%})"))
    return problems


def problems_in(path: Path) -> list[Problem]:
    """Every problem of one quiz file: JSON syntax, schema, then the semantic rules."""
    file = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
    try:
        quiz = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        return [Problem(file, "$", f"cannot read: {exc}")]
    except json.JSONDecodeError as exc:
        return [Problem(file, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: "
                                   f"{exc.msg}")]
    problems = [Problem(file, error.json_path, error.message)
                for error in sorted(validator().iter_errors(quiz), key=lambda e: e.json_path)]
    if problems:
        return problems
    if path.parent.name != quiz["lesson"] and path.parent.parent.name == "lessons":
        problems.append(Problem(file, "$.lesson", f"{quiz['lesson']!r} but the quiz lives in "
                                                  f"{path.parent.name}"))
    sections = readme_sections(path.parent) if (path.parent / "README.md").exists() else None
    return problems + semantic_errors(quiz, file, sections) + balance_errors(quiz, file)


def load_quiz(path: Path) -> dict:
    """A valid quiz, or QuizError naming the file and the field of the first problem."""
    problems = problems_in(path)
    if problems:
        raise QuizError(str(problems[0]))
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- grading


def parse_answer(question: dict, text: str) -> set[int] | float:
    """A learner's answer: letters for choice questions ("B", "ac"), a number for numeric.
    Raises ValueError with a one-line reason."""
    text = text.strip()
    if question["type"] == "numeric":
        try:
            return float(text.replace(",", "").replace("_", ""))
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
    letters = LETTERS[: len(question["options"])]
    picked = {letters.index(ch) for ch in text.upper() if ch in letters}
    if not text or any(ch not in letters for ch in text.upper().replace(" ", "")):
        raise ValueError(f"answer with letters from {letters[0]}-{letters[-1]}")
    if question["type"] == "single" and len(picked) != 1:
        raise ValueError("pick exactly one letter")
    return picked


def is_correct(question: dict, answer: set[int] | float) -> bool:
    if question["type"] == "numeric":
        return abs(float(answer) - question["answer"]) <= question["tolerance"]
    return answer == {i for i, option in enumerate(question["options"]) if option["correct"]}


def feedback(question: dict, answer: set[int] | float) -> list[str]:
    """Lines to show after an answer: verdict, then the explanation of each chosen option
    (and of each correct option the learner missed)."""
    right = is_correct(question, answer)
    lines = ["Correct!" if right else "Not quite."]
    if question["type"] == "numeric":
        tolerance = f" (within {question['tolerance']:g})" if question["tolerance"] else ""
        lines.append(f"Answer: {question['answer']:g} {question['unit']}{tolerance}.")
        lines.append(question["explanation"])
        return lines
    options = question["options"]
    correct = {i for i, option in enumerate(options) if option["correct"]}
    if not right:
        lines.append("Answer: " + ", ".join(LETTERS[i] for i in sorted(correct)))
    for i in sorted(answer | correct):
        mark = "you chose" if i in answer else "you missed"
        lines.append(f"  {LETTERS[i]} ({mark}, {'right' if options[i]['correct'] else 'wrong'}): "
                     f"{options[i]['explanation']}")
    return lines
