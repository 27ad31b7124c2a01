"""`python -m course run [IDS] [--json PATH]`: run lesson demos, one summary table.
`python -m course grade [IDS]`: run the lessons' unittest suites, a per-lesson report.
`python -m course catalog`: validate catalog.json against the schema and the folders.
`python -m course gpu [IDS]`: the GPU suite: every lesson with --device cuda and every notebook
on the GPUs present, one report (exit 2 when no GPU is visible: blocked, not passed).
`python -m course site [--out DIR]`: build the offline learner site."""

from __future__ import annotations

import argparse
import json
import os
import re
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


def _run(command: list[str], timeout: float) -> tuple[int, str, float]:
    """Run a command in the repository root; (exit code, combined output, seconds).
    A command past its timeout is killed with its whole process group."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
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


def run_demos(keys: list[str], json_path: Path | None, timeout: float, extra: list[str]) -> int:
    lessons = select_lessons(load_catalog(), keys)
    console = _console()
    rows = []
    for lesson in lessons:
        with tempfile.TemporaryDirectory() as tmp:
            report_path = Path(tmp) / "report.json"
            console.print(f"running {lesson['folder']} ...")
            code, output, seconds = _run([sys.executable, lesson["paths"]["script"], "--json",
                                          str(report_path), *extra], timeout)
            report = json.loads(report_path.read_text()) if report_path.exists() else {}
        passed = code == 0 and report.get("passed") is True
        headline = report.get("metrics", {}).get("headline", "")
        if not passed:
            tail = [line for line in output.strip().splitlines() if line.strip()][-3:]
            headline = " | ".join(tail)[-300:]
        rows.append({"lesson": lesson["id"], "folder": lesson["folder"], "passed": passed,
                     "exit_code": code, "seconds": round(seconds, 2), "headline": headline,
                     "checks": len(report.get("checks", []))})
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
    console.print(f"{len(rows) - len(failed)} of {len(rows)} lesson demos passed in {total:.1f} s")
    if json_path:
        json_path.write_text(json.dumps({"passed": not failed, "lessons": rows}, indent=2) + "\n")
    return 1 if failed else 0


_RAN = re.compile(r"^Ran (\d+) tests? in ([\d.]+)s", re.M)
_COUNTS = re.compile(r"(failures|errors|skipped|expected failures|unexpected successes)=(\d+)")


def grade(keys: list[str], timeout: float) -> int:
    lessons = select_lessons(load_catalog(), keys)
    console = _console()
    table = Table(title="lesson grades", title_justify="left")
    for column in ("lesson", "result", "tests", "failed", "errors", "skipped", "seconds"):
        table.add_column(column)
    all_ok = True
    details = []
    for lesson in lessons:
        console.print(f"grading {lesson['folder']} ...")
        code, output, seconds = _run([sys.executable, "-m", "unittest", "discover", "-s",
                                      lesson["paths"]["tests"], "-t", "."], timeout)
        ran = _RAN.search(output)
        tests = int(ran.group(1)) if ran else 0
        counts = {name: int(value) for name, value in _COUNTS.findall(output.splitlines()[-1]
                                                                      if output else "")}
        ok = code == 0 and tests > 0
        all_ok &= ok
        table.add_row(lesson["folder"].split("/")[-1], "[green]PASS[/]" if ok else "[red]FAIL[/]",
                      str(tests), str(counts.get("failures", 0)), str(counts.get("errors", 0)),
                      str(counts.get("skipped", 0)), f"{seconds:.1f}")
        if not ok:
            failing = re.findall(r"^(?:FAIL|ERROR): (.+)$", output, re.M)
            details.append(f"{lesson['folder']}: " + ("; ".join(failing) if failing else
                                                       ("no test ran" if not tests else
                                                        output.strip().splitlines()[-1])))
    console.print(table)
    for line in details:
        console.print(f"[red]{line}[/]")
    return 0 if all_ok else 1


def gpu_count() -> int:
    """CUDA devices visible to a fresh process (this runner never imports torch itself)."""
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
        if world is None:
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
                  f"{outcomes.count('blocked')} blocked")
    if "failed" in outcomes:
        return 1
    return 2 if "blocked" in outcomes else 0


def check_catalog() -> int:
    try:
        catalog = json.loads((REPO_ROOT / "catalog.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"catalog.json: $: {exc}")
        return 1
    problems = catalog_problems(catalog)
    for problem in problems:
        print(problem)
    if not problems:
        for lesson in catalog["lessons"]:
            print(f"{lesson['id']}  {lesson['title']}  ({lesson['minutes']} min, "
                  f"{lesson['questions']} questions)")
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
    grade_parser = sub.add_parser("grade", help="run the lessons' unittest suites")
    grade_parser.add_argument("ids", nargs="*", help="lesson ids; default all")
    grade_parser.add_argument("--timeout", type=float, default=600.0, help="seconds per lesson")
    sub.add_parser("catalog", help="validate catalog.json and list the lessons")
    gpu_parser = sub.add_parser("gpu", help="the GPU suite: every lesson with --device cuda, and "
                                            "every notebook, on the GPUs present")
    gpu_parser.add_argument("ids", nargs="*", help="lesson ids; default all")
    gpu_parser.add_argument("--timeout", type=float, default=900.0, help="seconds per demo/notebook")
    gpu_parser.add_argument("--no-notebooks", action="store_true", help="demos only")
    site_parser = sub.add_parser("site", help="build the offline learner site from catalog.json")
    site_parser.add_argument("--out", type=Path, default=REPO_ROOT / "_site",
                             help="output directory (default _site; emptied first)")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            extra = (["--quick"] if args.quick else []) + shlex.split(args.demo_args)
            return run_demos(args.ids, args.json, args.timeout, extra)
        if args.command == "grade":
            return grade(args.ids, args.timeout)
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
        return check_catalog()
    except CatalogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
