"""`python -m course run [IDS] [--json PATH] [--isolated]`: run lesson demos, one summary table
(in this process, torch imported once: course/demos.py; --isolated: a process per demo).
`python -m course grade [IDS] [--workspace DIR]`: grade by exercise with the lessons' own suites.
`python -m course exercise NN [--out DIR] [--exercise ID]`: a learner workspace with stubs.
`python -m course catalog`: validate catalog.json against the schema and the folders.
`python -m course gpu [IDS]`: the GPU suite: every lesson with --device cuda and every notebook
on the GPUs present, one report (exit 2 when no GPU is visible: blocked, not passed).
`python -m course site [--out DIR]`: build the offline learner site.
`python -m course mutants NN [--exercise ID]`: mutation testing of the exercises (not run by CI)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from course import REPO_ROOT, CatalogError, catalog_problems, load_catalog, select_lessons


def _console() -> Console:
    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


def _run(command: list[str], timeout: float, cwd: Path = REPO_ROOT) -> tuple[int, str, float]:
    """Run a command in `cwd` (the repository root); (exit code, combined output, seconds).
    A command past its timeout is killed with its whole process group."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        output += f"\n(killed after {timeout:g} s)"
        code = 124
    return code, output, time.monotonic() - started


def run_demos(keys: list[str], json_path: Path | None, timeout: float, extra: list[str],
              isolated: bool = False) -> int:
    """Every demo, one summary table. In this process (torch imported once, one forkserver for
    every demo's ranks: course/demos.py) unless `isolated` or the start method is spawn."""
    from course.demos import InProcessDemos

    lessons = select_lessons(load_catalog(), keys)
    console = _console()
    in_process = None if isolated or not InProcessDemos.usable() else InProcessDemos()
    rows = []
    try:
        for lesson in lessons:
            with tempfile.TemporaryDirectory() as tmp:
                report_path = Path(tmp) / "report.json"
                console.print(f"running {lesson['folder']} ...")
                argv = ["--json", str(report_path), *extra]
                code, output, seconds = (in_process.run(lesson, argv, timeout) if in_process else
                                         _run([sys.executable, lesson["paths"]["script"], *argv],
                                              timeout))
                report = json.loads(report_path.read_text()) if report_path.exists() else {}
            passed = code == 0 and report.get("passed") is True
            headline = report.get("metrics", {}).get("headline", "")
            if not passed:
                tail = [line for line in output.strip().splitlines() if line.strip()][-3:]
                headline = " | ".join(tail)[-300:]
            rows.append({"lesson": lesson["id"], "folder": lesson["folder"], "passed": passed,
                         "exit_code": code, "seconds": round(seconds, 2), "headline": headline,
                         "checks": len(report.get("checks", [])), "metrics": report.get("metrics", {})})
    finally:
        if in_process:
            in_process.close()
    table = Table(title="lesson demos", title_justify="left")
    for column in ("lesson", "result", "checks", "seconds", "headline"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["folder"].split("/")[-1], "[green]PASS[/]" if row["passed"] else
                      f"[red]FAIL (exit {row['exit_code']})[/]", str(row["checks"]),
                      f"{row['seconds']:.1f}", row["headline"])
    console.print(table)
    failed = [row["folder"] for row in rows if not row["passed"]]
    total = sum(row["seconds"] for row in rows)
    mode = "in one process" if in_process else "one process each"
    console.print(f"{len(rows) - len(failed)} of {len(rows)} lesson demos passed in {total:.1f} s "
                  f"({mode})")
    if json_path:
        json_path.write_text(json.dumps({"passed": not failed, "in_one_process": bool(in_process),
                                         "lessons": rows}, indent=2) + "\n")
    return 1 if failed else 0


def grade_lesson(lesson: dict, workspace: Path, timeout: float,
                 exercise: str | list[str] | None = None, first_failure: bool = False) -> dict:
    """Run a lesson's suite in `workspace` (the course itself for the reference) through
    lessons/_grading.py; returns {"criteria": {...}, "tests": [...], "seconds", "error"}."""
    from lessons._exercises import lesson_exercises

    folder = REPO_ROOT / lesson["folder"]
    exercises = {e.id: e for e in lesson_exercises(folder)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "grade.json"
        command = [sys.executable, "-m", "lessons._grading", lesson["paths"]["tests"], "--json", str(out)]
        wanted = [exercise] if isinstance(exercise, str) else list(exercise or [])
        for exercise_id in wanted:
            command += ["--exercise", exercise_id]
        if first_failure:
            command.append("--first-failure")
        code, output, seconds = _run(command, timeout, cwd=workspace)
        report = json.loads(out.read_text()) if out.exists() else {"criteria": {}, "tests": []}
    report["seconds"] = seconds
    report["error"] = "" if out_ok(code, report) else (output.strip().splitlines() or ["no output"])[-1]
    for exercise_id in exercises:  # an exercise no test grades cannot pass
        if not wanted or exercise_id in wanted:
            report["criteria"].setdefault(exercise_id, {"outcome": "failed", "tests": 0, "failed": 0,
                                                        "blocked": 0, "message": "no test grades it"})
    for exercise_id, entry in report["criteria"].items():
        entry["points"] = exercises[exercise_id].points if exercise_id in exercises else 0
        entry["title"] = exercises[exercise_id].title if exercise_id in exercises else \
            "the lesson as a whole: demo, CLI, docs numbers"
    return report


def grade_planted_bugs(lesson: dict | list[dict], workspace: Path, timeout: float,
                       untouched: dict | None = None):
    """Plant each of the lessons' bugs in a reference `workspace` in turn and grade its own
    exercise (one process for all of them). One lesson: [{"id", "exercise", "outcome", ...}];
    a list of lessons: {lesson id: [...]} (the workspace must hold every one's tests). Given a
    dict `untouched`, each lesson is first graded with every exercise stubbed, as a fresh
    workspace, in the same process: {lesson id: grade report} lands in it."""
    chosen = lesson if isinstance(lesson, list) else [lesson]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bugs.json"
        code, output, _ = _run([sys.executable, "-m", "lessons._grading",
                                *[item["paths"]["tests"] for item in chosen], "--planted-bugs",
                                *(["--untouched"] if untouched is not None else []),
                                "--json", str(out)], timeout, cwd=workspace)
        if code != 0 or not out.exists():
            raise RuntimeError(f"planted-bug grading failed (exit {code}): {output[-1500:]}")
        report = json.loads(out.read_text())
    by_id = {item["id"]: report["lessons"][item["paths"]["tests"]] for item in chosen}
    if untouched is not None:
        untouched.update({item["id"]: report["untouched"][item["paths"]["tests"]] for item in chosen})
    return by_id if isinstance(lesson, list) else by_id[lesson["id"]]


def out_ok(code: int, report: dict) -> bool:
    return code == 0 and bool(report.get("tests"))


def grade(keys: list[str], timeout: float, workspace: Path | None = None,
          json_path: Path | None = None, exercise: str | None = None,
          first_failure: bool = False) -> int:
    """Grade each lesson by exercise: passed / failed / blocked and points. Exit 0 iff every
    runnable criterion passed and nothing was blocked, 1 if something failed (or did not run),
    3 if nothing failed but something was blocked (a skip is never a pass)."""
    lessons = select_lessons(load_catalog(), keys)
    console = _console()
    summary = []
    any_failed = any_blocked = False
    for lesson in lessons:
        name = lesson["folder"].split("/")[-1]
        root = workspace or REPO_ROOT
        console.print(f"grading {name} in {root} ...")
        report = grade_lesson(lesson, root, timeout, exercise, first_failure)
        table = Table(title=f"{name}: {root}", title_justify="left")
        for column in ("criterion", "points", "result", "tests", "detail"):
            table.add_column(column, overflow="fold")
        earned = possible = 0
        criteria = report["criteria"]
        order = sorted(criteria, key=lambda key: (key == "integration", key))
        for key in order:
            entry = criteria[key]
            possible += entry["points"]
            earned += entry["points"] if entry["outcome"] == "passed" else 0
            colour = {"passed": "green", "failed": "red", "blocked": "yellow"}[entry["outcome"]]
            table.add_row(key, str(entry["points"]) if key != "integration" else "-",
                          f"[{colour}]{entry['outcome'].upper()}[/]",
                          str(entry["tests"]) + (f" ({entry['not_run']} not run)"
                                                 if entry.get("not_run") else ""),
                          entry["message"])  # one line, shortened at a word by the grader
        console.print(table)
        failed = report["error"] or any(e["outcome"] == "failed" for e in criteria.values())
        blocked = any(e["outcome"] == "blocked" for e in criteria.values())
        any_failed |= bool(failed)
        any_blocked |= blocked
        if report["error"]:
            console.print(f"[red]{name}: the suite did not run: {report['error']}[/]")
        console.print(f"{name}: {earned} of {possible} points in {report['seconds']:.1f} s")
        if workspace is not None and (workspace / "EXERCISES.md").exists():
            from lessons._exercises import record_grade
            record_grade(workspace, REPO_ROOT / lesson["folder"], criteria, exercise)
        summary.append({"lesson": lesson["id"], "folder": lesson["folder"], "points": earned,
                        "possible": possible, "seconds": round(report["seconds"], 2),
                        "error": report["error"], "criteria": criteria, "tests": report["tests"]})
    if json_path:
        json_path.write_text(json.dumps({"lessons": summary}, indent=2) + "\n")
    return 1 if any_failed else 3 if any_blocked else 0


def make_exercise(key: str, out: Path | None, exercise: str | None) -> int:
    from lessons._exercises import ExerciseError, lesson_dir, write_workspace

    try:
        folder = lesson_dir(key)
        out = out or REPO_ROOT / "workspace" / folder.name
        exercises = write_workspace(folder, out, {exercise} if exercise else None)
    except ExerciseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"workspace for {folder.name} written to {out}")
    for item in exercises:
        todo = exercise is None or item.id == exercise
        print(f"  {item.id:<28} {item.points:>2} points  {'write' if todo else 'given'}: {item.title}")
    print(f"grade it with: python -m course grade {folder.name[:2]} --workspace {out}")
    return 0


def gpu_count() -> int:
    """CUDA devices visible to a fresh process (this runner never imports torch itself). An
    empty CUDA_VISIBLE_DEVICES hides every device (the CUDA Programming Guide, appendix
    "CUDA Environment Variables": "set to an empty string, no GPU devices are visible"; the
    CPU suite sets it): 0, without starting a process that imports torch to say so."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0


def gpu_world_size(hardware: dict, gpus: int) -> int | None:
    """Ranks for a lesson's GPU run: one per GPU up to its default (1 for single-process
    lessons); None when the lesson needs more GPUs than there are."""
    if hardware["default_ranks"] == 1:
        return 1
    world = max(1, min(gpus, hardware["default_ranks"]))
    return world if world >= hardware["min_ranks"] else None


def execute_notebook(path: Path, timeout: float) -> tuple[bool, str]:
    """Run a notebook top to bottom at full size (no COURSE_QUICK) with nbclient."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    env_quick = os.environ.pop("COURSE_QUICK", None)
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        return True, "ran to the end"
    except CellExecutionError as exc:
        return False, str(exc).strip().splitlines()[-1][:300]
    finally:
        if env_quick is not None:
            os.environ["COURSE_QUICK"] = env_quick


def gpu_suite(keys: list[str], timeout: float, notebooks: bool) -> int:
    lessons = select_lessons(load_catalog(), keys)
    console = _console()
    gpus = gpu_count()
    if gpus == 0:
        console.print("no CUDA GPU is visible: the GPU suite is blocked (run it on a GPU box; "
                      "the CPU suite is `python -m pytest`)")
        return 2
    console.print(f"{gpus} GPU(s) visible")
    table = Table(title=f"GPU suite on {gpus} GPU(s)", title_justify="left")
    for column in ("lesson", "part", "ranks", "result", "seconds", "detail"):
        table.add_column(column, overflow="fold")
    outcomes = []
    for lesson in lessons:
        name = lesson["folder"].split("/")[-1]
        world = gpu_world_size(lesson["hardware"], gpus)
        if not lesson["hardware"]["cuda"]:  # its demo refuses --device cuda (07, 08, 10)
            outcomes.append("skipped")
            table.add_row(name, "demo", "-", "[yellow]SKIPPED[/]", "-",
                          "a CPU demo (catalog: cuda false); its GPU part is in the notebook")
        elif world is None:
            outcomes.append("blocked")
            table.add_row(name, "demo", "-", "[yellow]BLOCKED[/]", "-",
                          f"needs {lesson['hardware']['min_ranks']} GPUs")
        else:
            console.print(f"running {name} on {world} GPU(s) ...")
            with tempfile.TemporaryDirectory() as tmp:
                report_path = Path(tmp) / "report.json"
                code, output, seconds = _run([sys.executable, lesson["paths"]["script"], "--device",
                                              "cuda", "--world-size", str(world), "--json",
                                              str(report_path)], timeout)
                report = json.loads(report_path.read_text()) if report_path.exists() else {}
            passed = code == 0 and report.get("passed") is True
            detail = report.get("metrics", {}).get("headline", "") if passed else \
                " | ".join([line for line in output.strip().splitlines() if line.strip()][-2:])[-300:]
            outcomes.append("passed" if passed else "failed")
            table.add_row(name, "demo", str(world), "[green]PASS[/]" if passed else
                          f"[red]FAIL (exit {code})[/]", f"{seconds:.1f}", detail)
        if notebooks:
            started = time.monotonic()
            ok, detail = execute_notebook(REPO_ROOT / lesson["paths"]["notebook"], timeout)
            outcomes.append("passed" if ok else "failed")
            table.add_row(name, "notebook", "-", "[green]PASS[/]" if ok else "[red]FAIL[/]",
                          f"{time.monotonic() - started:.1f}", detail)
    console.print(table)
    console.print(f"{outcomes.count('passed')} passed, {outcomes.count('failed')} failed, "
                  f"{outcomes.count('blocked')} blocked, {outcomes.count('skipped')} skipped")
    if "failed" in outcomes:
        return 1
    return 2 if "blocked" in outcomes else 0


def check_catalog(sync: bool = False) -> int:
    try:
        catalog = json.loads((REPO_ROOT / "catalog.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"catalog.json: $: {exc}")
        return 1
    if sync:
        from course import sync_exercises
        catalog = sync_exercises(catalog)
        (REPO_ROOT / "catalog.json").write_text(json.dumps(catalog, indent=2, ensure_ascii=False) + "\n")
    problems = catalog_problems(catalog)
    for problem in problems:
        print(problem)
    if not problems:
        for lesson in catalog["lessons"]:
            exercises = lesson.get("exercises", [])
            points = sum(e["points"] for e in exercises)
            print(f"{lesson['id']}  {lesson['title']}  ({lesson['minutes']} min, "
                  f"{lesson['questions']} questions, {len(exercises)} exercises, {points} points)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run lesson demos and print one summary table")
    run_parser.add_argument("ids", nargs="*", help="lesson ids (01), slugs or folders; default all")
    run_parser.add_argument("--json", type=Path, metavar="PATH", help="write the summary as JSON")
    run_parser.add_argument("--timeout", type=float, default=180.0, help="seconds per lesson")
    run_parser.add_argument("--quick", action="store_true", help="pass --quick to every demo")
    run_parser.add_argument("--demo-args", default="", metavar="ARGS",
                            help="more arguments for every demo, e.g. --demo-args='--seed 3'")
    run_parser.add_argument("--isolated", action="store_true",
                            help="each demo in a fresh `python main.py` process (default: all in "
                                 "this one, torch imported once)")
    grade_parser = sub.add_parser("grade", help="grade lessons by exercise with their own tests")
    grade_parser.add_argument("ids", nargs="*", help="lesson ids; default all")
    grade_parser.add_argument("--workspace", type=Path, metavar="DIR",
                              help="a learner workspace (default: the reference solution)")
    grade_parser.add_argument("--exercise", metavar="ID", help="only this exercise's tests")
    grade_parser.add_argument("--first-failure", action="store_true",
                              help="stop each exercise at its first failing test: the same "
                                   "outcomes, sooner (later tests are reported as not run)")
    grade_parser.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    grade_parser.add_argument("--timeout", type=float, default=600.0, help="seconds per lesson")
    exercise_parser = sub.add_parser("exercise", help="write a learner workspace with stubs")
    exercise_parser.add_argument("id", help="lesson id (01), slug or folder")
    exercise_parser.add_argument("--out", type=Path, metavar="DIR",
                                 help="where (default workspace/NN_slug; refuses a folder with files)")
    exercise_parser.add_argument("--exercise", metavar="ID", help="stub only this exercise")
    mutants_parser = sub.add_parser("mutants", add_help=False,
                                    help="mutation testing of a lesson's exercises (course/mutants.py)")
    mutants_parser.add_argument("rest", nargs=argparse.REMAINDER)
    catalog_parser = sub.add_parser("catalog", help="validate catalog.json and list the lessons")
    catalog_parser.add_argument("--sync-exercises", action="store_true",
                                help="first copy each lesson's exercises from its main.py markers")
    gpu_parser = sub.add_parser("gpu", help="the GPU suite: every lesson with --device cuda, and "
                                            "every notebook, on the GPUs present")
    gpu_parser.add_argument("ids", nargs="*", help="lesson ids; default all")
    gpu_parser.add_argument("--timeout", type=float, default=900.0, help="seconds per demo/notebook")
    gpu_parser.add_argument("--no-notebooks", action="store_true", help="demos only")
    site_parser = sub.add_parser("site", help="build the offline learner site from catalog.json")
    site_parser.add_argument("--out", type=Path, default=REPO_ROOT / "_site",
                             help="output directory (default _site; emptied first)")
    args, unknown = parser.parse_known_args(argv)
    if args.command == "mutants":  # its own parser: python -m course mutants --help
        from course.mutants import main as mutants_main
        return mutants_main([*unknown, *args.rest])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "run":
            extra = (["--quick"] if args.quick else []) + shlex.split(args.demo_args)
            return run_demos(args.ids, args.json, args.timeout, extra, args.isolated)
        if args.command == "grade":
            if args.workspace is not None and not (args.workspace / "lessons").is_dir():
                parser.error(f"--workspace {args.workspace}: no lessons/ folder there "
                             f"(make one with: python -m course exercise NN)")
            return grade(args.ids, args.timeout, args.workspace, args.json, args.exercise,
                         args.first_failure)
        if args.command == "exercise":
            return make_exercise(args.id, args.out, args.exercise)
        if args.command == "gpu":
            return gpu_suite(args.ids, args.timeout, not args.no_notebooks)
        if args.command == "site":
            from course.site import SiteError, build_site
            try:
                pages = build_site(args.out)
            except SiteError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            print(f"{len(pages)} pages written to {args.out}; open {args.out / 'index.html'}")
            return 0
        return check_catalog(args.sync_exercises)
    except CatalogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
