"""Every quiz is valid; numeric answers are recomputed from the lesson's main.py; the quiz
tool's commands behave (scripted answers, end of input, bad files named by path)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from quizzes import LETTERS, find_quiz, is_correct, load_quiz, parse_answer, problems_in
from tests._course import REPO_ROOT, lesson_modules, lessons, lookup


def correct_answers(quiz: dict) -> list[str]:
    answers = []
    for question in quiz["questions"]:
        if question["type"] == "numeric":
            answers.append(repr(question["answer"]))
        else:
            answers.append("".join(LETTERS[i] for i, o in enumerate(question["options"])
                                   if o["correct"]))
    return answers


def run_quiz(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quizzes", *args], cwd=REPO_ROOT, input=stdin,
                          capture_output=True, text=True, timeout=60)


class TestEveryQuiz(unittest.TestCase):
    def test_every_lesson_has_a_valid_quiz(self):
        for lesson in lessons():
            with self.subTest(lesson=lesson["id"]):
                self.assertEqual(problems_in(REPO_ROOT / lesson["paths"]["quiz"]), [])

    def test_numeric_answers_are_recomputed_from_main_py(self):
        for lesson in lessons():
            modules = lesson_modules(lesson)
            quiz = load_quiz(REPO_ROOT / lesson["paths"]["quiz"])
            for question in quiz["questions"]:
                if question["type"] != "numeric":
                    continue
                with self.subTest(lesson=lesson["id"], question=question["id"]):
                    spec = question["check"]
                    function = lookup(modules, spec["function"])
                    self.assertTrue(callable(function), f"{spec['function']} is not in the lesson")
                    value = function(**spec["kwargs"])
                    if "index" in spec:
                        value = value[spec["index"]]
                    value *= spec.get("scale", 1)
                    # the quiz rounds for people; the rounding must fit inside its tolerance
                    self.assertLessEqual(abs(value - question["answer"]),
                                         question["tolerance"] + 1e-9 * abs(value), question["id"])

    def test_correct_answers_score_full_marks_and_wrong_ones_do_not(self):
        for lesson in lessons():
            quiz = load_quiz(REPO_ROOT / lesson["paths"]["quiz"])
            for question, answer in zip(quiz["questions"], correct_answers(quiz)):
                self.assertTrue(is_correct(question, parse_answer(question, answer)))
                if question["type"] == "numeric":
                    wrong = question["answer"] + 10 * question["tolerance"] + 1
                    self.assertFalse(is_correct(question, parse_answer(question, str(wrong))))


class TestQuizCommands(unittest.TestCase):
    def test_take_with_scripted_answers(self):
        quiz = load_quiz(find_quiz("01"))
        answers = correct_answers(quiz)
        proc = run_quiz("take", "01", "--answers", ",".join(answers))
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn(f"Score: {len(answers)}/{len(answers)}", proc.stdout)
        wrong = ["A" if a != "A" else "B" for a in answers[:2]]
        proc = run_quiz("take", "01", "--answers", ",".join(wrong))
        self.assertIn("Not quite.", proc.stdout)
        self.assertIn("not answered", proc.stdout)

    def test_interactive_feedback_and_end_of_input(self):
        quiz = load_quiz(find_quiz("01"))
        first = quiz["questions"][0]
        chosen = next(i for i, o in enumerate(first["options"]) if not o["correct"])
        proc = run_quiz("take", "01", stdin=f"Z\n{LETTERS[chosen]}\n")  # Z is re-asked
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("try again", proc.stdout)
        self.assertIn(first["options"][chosen]["explanation"], proc.stdout)
        self.assertIn("(end of input)", proc.stdout)
        self.assertIn("Score: 0/1 answered", proc.stdout)
        self.assertNotIn("Traceback", proc.stderr)

    def test_bad_scripted_answer_and_unknown_lesson_exit_2(self):
        self.assertEqual(run_quiz("take", "01", "--answers", "Q").returncode, 2)
        proc = run_quiz("take", "99")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("no quiz for lesson '99'", proc.stderr)

    def test_check_names_file_and_json_path(self):
        quiz = json.loads(find_quiz("01").read_text())
        quiz["questions"][2]["options"][0].pop("explanation")
        quiz["questions"][3]["tolerance"] = -1
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp) / "quiz.json"
            bad.write_text(json.dumps(quiz))
            proc = run_quiz("check", str(bad))
            garbage = Path(tmp) / "garbage.json"
            garbage.write_text("{not json")
            proc_garbage = run_quiz("check", str(garbage))
        self.assertEqual(proc.returncode, 1)
        self.assertIn("$.questions[2]", proc.stdout)
        self.assertIn("$.questions[3].tolerance", proc.stdout)
        self.assertIn(str(bad), proc.stdout)
        self.assertEqual(proc_garbage.returncode, 1)
        self.assertIn("invalid JSON at line 1", proc_garbage.stdout)

    def test_semantic_rules(self):
        quiz = json.loads(find_quiz("01").read_text())
        for question in quiz["questions"]:
            if question["type"] == "single":
                for option in question["options"]:
                    option["correct"] = False
                question["options"][0]["correct"] = True
        quiz["questions"][0]["section"] = "Nowhere"
        quiz["questions"] = [q for q in quiz["questions"] if q["type"] != "numeric"][:7] + \
            [next(q for q in quiz["questions"] if q["type"] == "numeric")]
        with tempfile.TemporaryDirectory() as tmp:
            lesson_dir = Path(tmp) / "01_collectives"
            lesson_dir.mkdir()
            (lesson_dir / "README.md").write_text((find_quiz("01").parent / "README.md").read_text())
            path = lesson_dir / "quiz.json"
            path.write_text(json.dumps(quiz))
            text = "\n".join(map(str, problems_in(path)))
        self.assertIn("every single-choice answer is option A", text)
        self.assertIn("numeric questions, need at least 2", text)
        self.assertIn("'Nowhere' is not a '## ' heading", text)

    def test_check_command_passes_on_the_course(self):
        proc = run_quiz("check")
        self.assertEqual(proc.returncode, 0, proc.stdout)
        self.assertIn("0 problem(s)", proc.stdout)


if __name__ == "__main__":
    unittest.main()
