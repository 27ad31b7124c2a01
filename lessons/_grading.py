"""Grade a lesson's unittest suite by exercise: `python -m lessons._grading TESTS_DIR --json OUT
[--exercise ID ...] [--first-failure]`, run from the root of a workspace (or of the course).

Every test belongs to one criterion: the exercise its `exercise("id")` tag names (on the test
method or its TestCase class), else "integration". A criterion is *passed* when every one of its
tests passed, *failed* when one failed or errored (the first failing assertion is kept), and
*blocked* when none failed but one was skipped (a GPU or a package is missing): a skip is never
a pass. Writes {"tests": [...], "criteria": {...}} as JSON.

`--first-failure` stops each criterion at its first failing test (and that test at its first
failing subTest, as unittest's failfast does): its later tests are reported "not run", and a
test class none of whose criteria can still pass is not set up at all (no ranks launched for
it). The outcome of every criterion is the same as without it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
import textwrap
import time
import traceback
import unittest
from pathlib import Path

from lessons._testing import selecting

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


MESSAGE_CHARS = 600  # a grader message longer than this is shortened at a word boundary


def shorten(text: str, width: int = MESSAGE_CHARS) -> str:
    """`text` on one line, cut at a word boundary (never mid-word) with " [...]" if too long."""
    return textwrap.shorten(" ".join(text.split()), width, placeholder=" [...]") or text[:width]


def _where(tb) -> str:
    """Where an error (not a failed assertion) was raised: the innermost frame in the lessons'
    code, as "in fn (lessons/NN_slug/file.py:line)" (empty when none is in the lessons)."""
    lessons, tests = f"{os.sep}lessons{os.sep}", f"{os.sep}tests{os.sep}"
    frames = [frame for frame in traceback.extract_tb(tb)
              if lessons in frame.filename and tests not in frame.filename]
    if not frames:
        return ""
    frame = frames[-1]
    path = frame.filename[frame.filename.rindex(lessons) + 1:]
    return f" (in {frame.name}, {path}:{frame.lineno})"


def _first_failure(err) -> str:
    """One line that says what failed: the whole assertion message (unittest puts a test's own
    message after the standard one, which may span lines: "Lists differ: ... : <msg>"), without
    the line-by-line diff, and for an error the place in the lesson's code that raised it."""
    kind, value, tb = err
    text = "".join(traceback.format_exception_only(kind, value)).strip().splitlines()
    kept = [line for line in text if line.strip() and not re.match(r"^[-+?] ", line)
            and not line.startswith("Diff is ")]
    where = "" if issubclass(kind, AssertionError) else _where(tb)
    return shorten(" ".join(kept) + where if kept else kind.__name__ + where)


NOT_RUN = "not run: an earlier test of this criterion failed (--first-failure)"


def _not_run(*args, **kwargs):  # stands in for a test method that --first-failure skips
    raise AssertionError("unreachable")


_not_run.__unittest_skip__ = True
_not_run.__unittest_skip_why__ = NOT_RUN


class _Recorder(unittest.TestResult):
    def __init__(self, first_failure: bool = False) -> None:
        super().__init__()
        self.outcomes: dict[str, dict] = {}
        self._started: dict[str, float] = {}
        self.first_failure = first_failure
        # unittest's failfast ends a test at its first failing subTest (TestCase.subTest raises
        # _ShouldStop); stop() below keeps it from ending the whole run: a failure ends only its
        # own criterion, which startTest enforces
        self.failfast = first_failure
        self.failed_criteria: set[str] = set()
        self._criterion: dict[str, str] = {}

    def stop(self):  # called by failfast on every failure: the other criteria still run
        pass

    def startTest(self, test):
        super().startTest(test)
        self._started[test.id()] = time.monotonic()
        self._criterion[test.id()] = criterion_of(test)  # before the method may be replaced
        if self.first_failure and self._criterion[test.id()] in self.failed_criteria:
            # unittest reads the method after startTest and skips a method marked as skipped
            setattr(test, test._testMethodName, _not_run)

    def _set(self, test, outcome: str, message: str = "") -> None:
        criterion = self._criterion.get(test.id()) or criterion_of(test)
        entry = self.outcomes.setdefault(test.id(), {"id": test.id(), "criterion": criterion,
                                                     "outcome": "passed", "message": ""})
        if entry["outcome"] in ("failed",):
            return  # keep the first failure (subtests may report several)
        entry["outcome"], entry["message"] = outcome, message
        if outcome == "failed":
            self.failed_criteria.add(entry["criterion"])

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
        self._set(test, "not run" if reason == NOT_RUN else "blocked", reason)

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
                                                      "blocked": 0, "not_run": 0, "message": ""})
        entry["tests"] += 1
        if test["outcome"] == "not run":  # only after a failure of the same criterion
            entry["not_run"] += 1
        elif test["outcome"] == "failed":
            entry["failed"] += 1
            if entry["outcome"] != "failed":
                entry["outcome"], entry["message"] = "failed", f"{test['id']}: {test['message']}"
        elif test["outcome"] == "blocked":
            entry["blocked"] += 1
            if entry["outcome"] == "passed":
                entry["outcome"], entry["message"] = "blocked", test["message"]
    return result


def _by_class(tests: list) -> list[list]:
    """Consecutive runs of tests of the same class (discovery order kept)."""
    groups: list[list] = []
    for test in tests:
        if groups and type(groups[-1][0]) is type(test):
            groups[-1].append(test)
        else:
            groups.append([test])
    return groups


def _named(tests: list, name: str | None) -> list:
    """The tests whose id ends with `name`, an id under a tests folder ("test_x.TestY.test_z")."""
    return [t for t in tests if name and t.id().endswith("." + name)]


def grade(tests_dir: str, exercise: str | list[str] | None = None,
          first_failure: bool = False, first: str | None = None) -> dict:
    """Run the suite under `tests_dir` (only the tests of `exercise`, one id or several, if
    given) and return {"tests": [...], "criteria": {...}}, the tests in the order they ran.
    With `first_failure`, the test named by `first` (an id under tests_dir, "test_x.TestY.
    test_z") runs before the others, alone with its class's fixtures: a criterion fails iff one
    of its tests fails, whichever runs first."""
    loader = unittest.TestLoader()
    suite = loader.discover(tests_dir, top_level_dir=".")
    tests = _flatten(suite)
    broken = [t for t in tests if isinstance(t, unittest.loader._FailedTest)]
    if exercise is not None:
        wanted = {exercise} if isinstance(exercise, str) else set(exercise)
        tests = [t for t in tests if criterion_of(t) in wanted or t in broken]
    recorder = _Recorder(first_failure)
    hinted = _named(tests, first)[:1] if first_failure else []
    ordered = hinted + [t for t in tests if t not in hinted]
    with selecting(None if exercise is None else frozenset(wanted)):
        if not first_failure:
            unittest.TestSuite(tests).run(recorder)
        else:  # the hinted test alone, then one suite per class: its fixtures run inside it
            for group in ([hinted] if hinted else []) + _by_class(ordered[len(hinted):]):
                if {criterion_of(t) for t in group} <= recorder.failed_criteria:
                    for test in group:
                        recorder.outcomes[test.id()] = {"id": test.id(), "criterion": criterion_of(test),
                                                        "outcome": "not run", "message": NOT_RUN}
                    continue
                errors = len(recorder.errors)
                unittest.TestSuite(group).run(recorder)
                if any(not isinstance(test, unittest.TestCase) for test, _ in recorder.errors[errors:]) \
                        and any(test.id() not in recorder.outcomes for test in group):
                    # its class (or module) failed to set up: its tests fail, and so do their criteria
                    recorder.failed_criteria |= {criterion_of(test) for test in group}
    class_level = {key: entry for key, entry in recorder.outcomes.items()
                   if not any(key == t.id() for t in tests)}  # setUpClass (pkg.Class) etc.
    outcomes = [entry for key, entry in recorder.outcomes.items() if key not in class_level]
    for test in ordered:  # a test that never reported: its class or module failed to set up,
        if test.id() not in recorder.outcomes:  # or skipped itself there (blocked, as a test's skip)
            owner = f"{type(test).__module__}.{type(test).__qualname__}"
            key, entry = next(((key, entry) for key, entry in class_level.items() if owner in key),
                              (None, None))
            if entry is None:
                outcome, message = "failed", "did not run"
            elif entry["outcome"] == "blocked":
                outcome, message = "blocked", entry["message"]
            else:
                outcome, message = "failed", f"{key}: {entry['message']}"
            outcomes.append({"id": test.id(), "criterion": criterion_of(test),
                             "outcome": outcome, "message": message})
    return {"tests": outcomes, "criteria": criteria(outcomes)}


def _forget(package: str) -> None:
    """Drop a lesson's modules (technique, harness, tests) so the next import reads the disk."""
    for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def planted(texts: dict[Path, str]):
    """Within: each file holds its new text (a planted bug, a stub); after: its own text, its
    own modification time, and its own bytecode again. A workspace may hold the files' compiled
    bytecode (__pycache__, which Python trusts while the source's size and modification second
    match it): a changed file's bytecode is removed while it is changed, so that no process runs
    the original's code for it (a bug the same size as the line it replaces, planted within the
    same second), and no bug runs the code another bug left there (where processes write
    bytecode); afterwards the original's bytecode is put back beside its original time, valid
    again (where processes cannot write bytecode, every later import would compile it again)."""
    saved = {}
    for path in texts:
        cache = Path(importlib.util.cache_from_source(str(path)))
        saved[path] = (path.read_text(), path.stat(), cache, cache.read_bytes() if cache.exists() else None)
    try:
        for path, text in texts.items():
            path.write_text(text)
            saved[path][2].unlink(missing_ok=True)
        yield
    finally:
        for path, (text, stat, cache, code) in saved.items():
            path.write_text(text)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            if code is None:
                cache.unlink(missing_ok=True)
            else:
                cache.write_bytes(code)


class BugTimeout(Exception):
    """A planted bug (or a mutant) made its exercise's tests run past --bug-timeout."""


def _on_alarm(signum, frame):
    raise BugTimeout("the tests ran past the bug's time limit (a hang counts as caught)")


def grade_planted_bugs(tests_dir: str, bugs_file: str | None = None,
                       timeout_s: float | None = None, progress: bool = False) -> dict:
    """Plant each of the lesson's bugs (bugs.json, or the specs in `bugs_file`: the same
    fields, e.g. mutants from course/mutants.py) in turn, in place, into the working copy the
    process runs in (a reference workspace), grade that bug's exercise alone up to its first
    failure (its `caught_by` hint first), and restore the file. One process for all the bugs:
    the interpreter and the forkserver start once. `timeout_s`: a bug whose grading runs longer
    is stopped (its launches kill their ranks) and counts as caught ("timeout"). Returns
    {"bugs": [{"id", "exercise", "outcome", "message", "caught_by" (the first failing test),
    "hint", "seconds"}]}."""
    from lessons._exercises import PlantedBug, planted_bugs

    folder = Path(tests_dir).resolve().parent
    package = f"lessons.{folder.name}"
    if bugs_file is None:
        bugs = planted_bugs(folder)
    else:
        fields = ("id", "exercise", "file", "find", "replace", "mistake")
        bugs = [PlantedBug(**{key: spec[key] for key in fields})
                for spec in json.loads(Path(bugs_file).read_text())]
    results = []
    previous = signal.signal(signal.SIGALRM, _on_alarm) if timeout_s else None
    try:
        for number, bug in enumerate(bugs, 1):
            target = folder / bug.file
            started = time.monotonic()
            try:
                with planted({target: target.read_text().replace(bug.find, bug.replace, 1)}):
                    _forget(package)
                    try:
                        if timeout_s:
                            signal.setitimer(signal.ITIMER_REAL, timeout_s)
                        report = grade(tests_dir, bug.exercise, first_failure=True, first=bug.caught_by)
                    finally:
                        if timeout_s:
                            signal.setitimer(signal.ITIMER_REAL, 0)
                entry = report["criteria"].get(bug.exercise, {"outcome": "failed", "message": "no tests"})
                failing = [test["id"] for test in report["tests"] if test["outcome"] == "failed"]
                entry = {**entry, "caught_by": failing[0].split(".tests.", 1)[-1] if failing else ""}
            except BugTimeout as exc:
                entry = {"outcome": "timeout", "message": str(exc), "caught_by": ""}
            finally:
                _forget(package)
            results.append({"id": bug.id, "exercise": bug.exercise, "mistake": bug.mistake,
                            "outcome": entry["outcome"], "message": entry["message"],
                            "caught_by": entry["caught_by"], "hint": bug.caught_by,
                            "seconds": round(time.monotonic() - started, 2)})
            if progress:
                print(f"[{number}/{len(bugs)}] {bug.id}: {entry['outcome']} "
                      f"({results[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGALRM, previous)
    return {"bugs": results}


def passes_alone(tests_dir: str, exercise: str, test: str) -> bool:
    """Whether the test `test` ("test_x.TestY.test_z") passes run alone, with only its class's
    fixtures, on the code as it is: a hint must not depend on the tests before it."""
    found = _named(_flatten(unittest.TestLoader().discover(tests_dir, top_level_dir=".")), test)
    recorder = _Recorder()
    with selecting(frozenset({exercise})):
        unittest.TestSuite(found[:1]).run(recorder)
    return len(found) == 1 and [entry["outcome"] for entry in recorder.outcomes.values()] == ["passed"]


def write_hints(tests_dir: str, results: list[dict], lessons_root: Path,
                timeout_s: float | None = None) -> list[str]:
    """Record in `lessons_root`/<lesson>/bugs.json, as each bug's "caught_by", the test that
    failed first for it in `results` (grade_planted_bugs), once the hint is stable: graded
    again with it first, the bug is caught first by that same test (a bug that breaks a class's
    fixtures fails its tests in file order, not the hinted one first; a test whose verdict
    depends on the tests before it moves), at most three rounds; and the test passes alone on
    the reference. Returns the bugs left without a hint."""
    folder = Path(tests_dir).resolve().parent
    workspace_bugs = folder / "bugs.json"  # the copy this process grades in
    original = workspace_bugs.read_text()
    hints = {r["id"]: r["caught_by"] for r in results if r["outcome"] == "failed" and r["caught_by"]}
    stable: dict[str, str] = {}
    try:
        for _ in range(3):
            specs = json.loads(original)
            for spec in specs:
                spec["caught_by"] = hints.get(spec["id"], "")
            workspace_bugs.write_text(json.dumps(specs))
            again = {r["id"]: r for r in grade_planted_bugs(tests_dir, timeout_s=timeout_s)["bugs"]}
            stable = {key: test for key, test in hints.items() if again[key]["caught_by"] == test}
            hints = {key: again[key]["caught_by"] for key in hints if again[key]["caught_by"]}
            if len(stable) == len(hints):
                break
    finally:
        workspace_bugs.write_text(original)
        _forget(f"lessons.{folder.name}")
    exercise_of = {r["id"]: r["exercise"] for r in results}
    alone = {key: passes_alone(tests_dir, exercise_of[key], test) for key, test in stable.items()}
    _forget(f"lessons.{folder.name}")
    path = lessons_root / folder.name / "bugs.json"
    specs, unhinted = json.loads(path.read_text()), []
    for spec in specs:
        if alone.get(spec["id"]):
            spec["caught_by"] = stable[spec["id"]]
        else:
            spec.pop("caught_by", None)
            unhinted.append(spec["id"])
    path.write_text(json.dumps(specs, indent=2, ensure_ascii=False) + "\n")
    return unhinted


def grade_untouched(tests_dir: str) -> dict:
    """The lesson's exercises stubbed in place, as `course exercise` writes them (a reference
    workspace: the files are restored after), each exercise graded up to its first failure:
    grade()'s report and "seconds". What a learner's untouched workspace scores, without a
    process of its own per lesson (the planted-bug process's torch and forkserver are warm)."""
    from lessons._exercises import lesson_exercises, stub_source

    folder = Path(tests_dir).resolve().parent
    package = f"lessons.{folder.name}"
    exercises = lesson_exercises(folder)
    stubs = {folder / name: stub_source((folder / name).read_text(), [e for e in exercises if e.file == name])
             for name in sorted({e.file for e in exercises})}
    started = time.monotonic()
    try:
        with planted(stubs):
            _forget(package)
            report = grade(tests_dir, [e.id for e in exercises], first_failure=True)
    finally:
        _forget(package)
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lessons._grading")
    parser.add_argument("tests_dir", nargs="+",
                        help="a lesson's tests folder (several only with --planted-bugs)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--exercise", action="append", help="only this exercise's tests (repeatable)")
    parser.add_argument("--first-failure", action="store_true",
                        help="stop each criterion at its first failing test (same outcomes, faster)")
    parser.add_argument("--planted-bugs", action="store_true",
                        help="plant each bug of bugs.json in turn and grade its exercise "
                             "(run inside a reference workspace: files are changed and restored)")
    parser.add_argument("--bugs", metavar="FILE",
                        help="with --planted-bugs and one tests folder: plant these specs instead")
    parser.add_argument("--bug-timeout", type=float, metavar="SECONDS",
                        help="with --planted-bugs: stop a bug's grading after this long (caught)")
    parser.add_argument("--progress", action="store_true", help="with --planted-bugs: a line per bug")
    parser.add_argument("--write-hints", type=Path, metavar="LESSONS",
                        help="with --planted-bugs: write each bug's first failing test as its "
                             "caught_by hint into LESSONS/<lesson>/bugs.json (the course's lessons/)")
    parser.add_argument("--untouched", action="store_true",
                        help="with --planted-bugs: first grade each lesson with every exercise "
                             "stubbed (as a fresh workspace), reported under 'untouched'")
    args = parser.parse_args(argv)
    if args.bugs and (not args.planted_bugs or len(args.tests_dir) != 1):
        parser.error("--bugs needs --planted-bugs and one tests folder")
    if args.untouched and not args.planted_bugs:
        parser.error("--untouched needs --planted-bugs")
    if args.write_hints and (not args.planted_bugs or args.bugs):
        parser.error("--write-hints needs --planted-bugs and the lessons' own bugs.json")
    if args.planted_bugs:  # one process for every lesson named: torch and the forkserver start once
        report: dict = {"lessons": {}, "untouched": {}}
        for tests_dir in args.tests_dir:
            if args.untouched:
                report["untouched"][tests_dir] = grade_untouched(tests_dir)
            report["lessons"][tests_dir] = grade_planted_bugs(tests_dir, args.bugs, args.bug_timeout,
                                                              args.progress)["bugs"]
            if args.write_hints:
                unhinted = write_hints(tests_dir, report["lessons"][tests_dir], args.write_hints,
                                       args.bug_timeout)
                if unhinted:
                    print(f"{tests_dir}: no hint for {', '.join(unhinted)}", file=sys.stderr)
    elif len(args.tests_dir) == 1:
        report = grade(args.tests_dir[0], args.exercise, args.first_failure)
    else:
        parser.error("grade one tests folder at a time (several only with --planted-bugs)")
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
