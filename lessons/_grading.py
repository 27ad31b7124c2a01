"""Grade a lesson's unittest suite by exercise: `python -m lessons._grading TESTS_DIR --json OUT
[--exercise ID]`, run from the root of a workspace (or of the course).

Every test belongs to one criterion: the exercise its `exercise("id")` tag names (on the test
method or its TestCase class), else "integration". A criterion is *passed* when every one of its
tests passed, *failed* when one failed or errored (the first failing assertion is kept), and
*blocked* when none failed but one was skipped (a GPU or a package is missing): a skip is never
a pass. Writes {"tests": [...], "criteria": {...}} as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import unittest
from pathlib import Path

INTEGRATION = "integration"


def criterion_of(test: unittest.TestCase) -> str:
    method = getattr(test, getattr(test, "_testMethodName", ""), None)
    return getattr(method, "_exercise", None) or getattr(type(test), "_exercise", None) or INTEGRATION


def _flatten(suite) -> list:
    found, stack = [], [suite]
    while stack:
        item = stack.pop()
        if isinstance(item, unittest.TestSuite):
            stack.extend(reversed(list(item)))
        else:
            found.append(item)
    return found


def _first_failure(err) -> str:
    kind, value, _ = err
    text = "".join(traceback.format_exception_only(kind, value)).strip().splitlines()
    return (text[0] if text else kind.__name__)[:400]


class _Recorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict] = {}
        self._started: dict[str, float] = {}

    def startTest(self, test):
        super().startTest(test)
        self._started[test.id()] = time.monotonic()

    def _set(self, test, outcome: str, message: str = "") -> None:
        entry = self.outcomes.setdefault(test.id(), {"id": test.id(), "criterion": criterion_of(test),
                                                     "outcome": "passed", "message": ""})
        if entry["outcome"] in ("failed",):
            return  # keep the first failure (subtests may report several)
        entry["outcome"], entry["message"] = outcome, message

    def addSuccess(self, test):
        self._set(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "failed", _first_failure(err))

    def addError(self, test, err):
        super().addError(test, err)
        if isinstance(test, unittest.TestCase):
            self._set(test, "failed", _first_failure(err))
        else:  # a setUpClass/module failure: `grade` fails every test of that class with it
            self.outcomes.setdefault(str(test), {"id": str(test), "criterion": INTEGRATION,
                                                 "outcome": "failed", "message": _first_failure(err)})

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "blocked", reason)

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._set(test, "failed", f"{subtest._subDescription()}: {_first_failure(err)}")

    def addExpectedFailure(self, test, err):
        self._set(test, "passed")

    def addUnexpectedSuccess(self, test):
        self._set(test, "failed", "unexpected success")

    def stopTest(self, test):
        super().stopTest(test)
        entry = self.outcomes.get(test.id())
        if entry is not None:
            entry["seconds"] = round(time.monotonic() - self._started.get(test.id(), time.monotonic()), 2)


def criteria(tests: list[dict]) -> dict[str, dict]:
    """Per criterion: outcome (passed / failed / blocked), counts and the first failure."""
    result: dict[str, dict] = {}
    for test in tests:
        entry = result.setdefault(test["criterion"], {"outcome": "passed", "tests": 0, "failed": 0,
                                                      "blocked": 0, "message": ""})
        entry["tests"] += 1
        if test["outcome"] == "failed":
            entry["failed"] += 1
            if entry["outcome"] != "failed":
                entry["outcome"], entry["message"] = "failed", f"{test['id']}: {test['message']}"
        elif test["outcome"] == "blocked":
            entry["blocked"] += 1
            if entry["outcome"] == "passed":
                entry["outcome"], entry["message"] = "blocked", test["message"]
    return result


def grade(tests_dir: str, exercise: str | None = None) -> dict:
    loader = unittest.TestLoader()
    suite = loader.discover(tests_dir, top_level_dir=".")
    tests = _flatten(suite)
    broken = [t for t in tests if isinstance(t, unittest.loader._FailedTest)]
    if exercise is not None:
        tests = [t for t in tests if criterion_of(t) == exercise or t in broken]
    recorder = _Recorder()
    unittest.TestSuite(tests).run(recorder)
    class_errors = {key: entry["message"] for key, entry in recorder.outcomes.items()
                    if not any(key == t.id() for t in tests)}  # setUpClass (pkg.Class) etc.
    outcomes = [entry for key, entry in recorder.outcomes.items() if key not in class_errors]
    for test in tests:  # a test that never reported: its class or module failed to set up
        if test.id() not in recorder.outcomes:
            owner = f"{type(test).__module__}.{type(test).__qualname__}"
            message = next((f"{key}: {text}" for key, text in class_errors.items() if owner in key),
                           "did not run")
            outcomes.append({"id": test.id(), "criterion": criterion_of(test),
                             "outcome": "failed", "message": message})
    return {"tests": outcomes, "criteria": criteria(outcomes)}


def _forget(package: str) -> None:
    """Drop a lesson's modules (technique, harness, tests) so the next import reads the disk."""
    for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
        del sys.modules[name]


def grade_planted_bugs(tests_dir: str) -> dict:
    """Plant each of the lesson's bugs (bugs.json) in turn, in place, into the working copy the
    process runs in (a reference workspace), grade that bug's exercise alone, and restore the
    file. One process for all the bugs: the interpreter and the forkserver start once.
    Returns {"bugs": [{"id", "exercise", "outcome", "message", "seconds"}]}."""
    from lessons._exercises import planted_bugs

    folder = Path(tests_dir).resolve().parent
    package = f"lessons.{folder.name}"
    results = []
    for bug in planted_bugs(folder):
        target = folder / bug.file
        original = target.read_text()
        started = time.monotonic()
        try:
            target.write_text(original.replace(bug.find, bug.replace, 1))
            _forget(package)
            report = grade(tests_dir, bug.exercise)
        finally:
            target.write_text(original)
            _forget(package)
        entry = report["criteria"].get(bug.exercise, {"outcome": "failed", "message": "no tests"})
        results.append({"id": bug.id, "exercise": bug.exercise, "mistake": bug.mistake,
                        "outcome": entry["outcome"], "message": entry["message"],
                        "seconds": round(time.monotonic() - started, 2)})
    return {"bugs": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lessons._grading")
    parser.add_argument("tests_dir")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--exercise")
    parser.add_argument("--planted-bugs", action="store_true",
                        help="plant each bug of bugs.json in turn and grade its exercise "
                             "(run inside a reference workspace: files are changed and restored)")
    args = parser.parse_args(argv)
    report = grade_planted_bugs(args.tests_dir) if args.planted_bugs else \
        grade(args.tests_dir, args.exercise)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
