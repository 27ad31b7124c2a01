"""The learner-facing static site, built from catalog.json: `python -m course site [--out DIR]`.

* Markdown: markdown-it-py (CommonMark + tables) with Pygments highlighting; ```mermaid fences
  become <pre class="mermaid"> blocks that the bundled mermaid.js renders to SVG in the browser;
  $...$ and $$...$$ math (mdit-py-plugins) is rendered by the bundled KaTeX.
* Pages: Jinja2 templates in course/templates; an index of every catalog lesson (time,
  prerequisites, concepts, quiz progress), one page per lesson (its README, links to main.py,
  tests and notebook, copied into the site, and the interactive quiz).
* Offline: mermaid and KaTeX come from the npm registry at build time (site/package.json, pinned
  by site/package-lock.json, installed once into .cache/site-npm) and are copied into the site;
  no CDN, no remote font.
* Figures: a lesson whose code draws pictures has `figures.py` beside its main.py with
  `site_figures(out_dir) -> [{"file", "alt", "caption"}]`; the build calls it (the pictures are
  drawn by the lesson's own code, at small sizes, on the machine that builds the site) and the
  lesson page shows them with their alt text. A figure that fails to draw fails the build.
* Exercises: each lesson page lists the exercises marked in its main.py, with points and the
  commands to get a workspace and grade it.
* A broken internal link (href/src to a missing file or anchor) fails the build.
"""

from __future__ import annotations

import html
import importlib
import json
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

from course import REPO_ROOT, load_catalog

SITE_SOURCE = REPO_ROOT / "site"
NPM_CACHE = REPO_ROOT / ".cache" / "site-npm"
TEMPLATES = Path(__file__).resolve().parent / "templates"
STATIC = Path(__file__).resolve().parent / "static"
VENDOR_FILES = {  # node_modules path -> assets path
    "mermaid/dist/mermaid.min.js": "vendor/mermaid.min.js",
    "katex/dist/katex.min.js": "vendor/katex/katex.min.js",
    "katex/dist/katex.min.css": "vendor/katex/katex.min.css",
}


class SiteError(RuntimeError):
    """The site cannot be built (missing assets, broken links); the message says what."""


# ----------------------------------------------------------------------------- assets


def vendor_assets(npm_dir: Path = NPM_CACHE) -> Path:
    """node_modules with mermaid and KaTeX at the versions site/package-lock.json pins,
    installed with `npm ci` on the first build (npm must be on PATH)."""
    marker = npm_dir / "package-lock.json"
    if not (marker.exists() and marker.read_bytes() == (SITE_SOURCE / "package-lock.json").read_bytes()
            and (npm_dir / "node_modules" / "mermaid").exists()):
        npm = shutil.which("npm")
        if npm is None:
            raise SiteError("npm is needed once to install mermaid and KaTeX (site/package.json)")
        npm_dir.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(SITE_SOURCE / name, npm_dir / name)
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
                              cwd=npm_dir, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SiteError(f"npm ci failed in {npm_dir}: {proc.stderr.strip()[-500:]}")
    return npm_dir / "node_modules"


def copy_assets(out: Path, node_modules: Path) -> None:
    assets = out / "assets"
    for source, target in VENDOR_FILES.items():
        destination = assets / target
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(node_modules / source, destination)
    shutil.copytree(node_modules / "katex/dist/fonts", assets / "vendor/katex/fonts",
                    dirs_exist_ok=True)
    for path in STATIC.iterdir():
        shutil.copy(path, assets / path.name)
    (assets / "pygments.css").write_text(HtmlFormatter(style="friendly").get_style_defs(".highlight"))


# ----------------------------------------------------------------------------- markdown


def _highlight(code: str, language: str, _attrs) -> str:
    if language == "mermaid":
        return f'<pre class="mermaid">{html.escape(code)}</pre>'
    try:
        lexer = get_lexer_by_name(language or "text")
    except ClassNotFound:
        lexer = get_lexer_by_name("text")
    return highlight(code, lexer, HtmlFormatter(nowrap=False))


def markdown_renderer() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"highlight": _highlight, "html": False}).enable("table")
    md.use(dollarmath_plugin, double_inline=True)
    return md


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def render_markdown(text: str, link_map: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """HTML of a lesson README, with ids on headings (for the table of contents) and links to
    sibling files rewritten through `link_map` (relative path -> site path)."""
    md = markdown_renderer()
    tokens = md.parse(text)
    toc = []
    for index, token in enumerate(tokens):
        if token.type == "heading_open":
            title = tokens[index + 1].content
            anchor = slugify(title)
            token.attrSet("id", anchor)
            if token.tag == "h2":
                toc.append((anchor, title))
        if token.type == "inline" and token.children:
            for child in token.children:
                if child.type == "link_open":
                    href = child.attrGet("href") or ""
                    if href in link_map:
                        child.attrSet("href", link_map[href])
    return md.renderer.render(tokens, md.options, {}), toc


# ----------------------------------------------------------------------------- pages


def lesson_links(lesson: dict) -> dict[str, str]:
    """Site paths of the lesson's files, copied under src/ (relative to a lesson page)."""
    return {key: f"../src/{lesson['paths'][key]}" for key in ("script", "tests", "notebook", "quiz")}


def lesson_files(lesson: dict) -> list[str]:
    """The lesson folder's own files a README may link to: its Python modules (technique,
    checks, bench, trainer, figures) and its planted bugs."""
    folder = REPO_ROOT / lesson["folder"]
    return sorted(path.name for path in folder.iterdir()
                  if path.is_file() and path.suffix in (".py", ".json") and path.name != "__init__.py")


def copy_sources(out: Path, lesson: dict) -> None:
    """The lesson's files (main.py, checks.py, ..., quiz, bugs), its notebook and test files, as
    files the pages can link to."""
    for key in ("script", "quiz", "notebook", "docs"):
        source = REPO_ROOT / lesson["paths"][key]
        target = out / "src" / lesson["paths"][key]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
    for name in lesson_files(lesson):
        shutil.copy(REPO_ROOT / lesson["folder"] / name, out / "src" / lesson["folder"] / name)
    tests = REPO_ROOT / lesson["paths"]["tests"]
    listing = []
    for path in sorted(tests.rglob("*.py")):
        relative = path.relative_to(REPO_ROOT)
        (out / "src" / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / "src" / relative)
        listing.append(str(path.relative_to(tests)))
    index = out / "src" / lesson["paths"]["tests"] / "index.html"
    items = "".join(f'<li><a href="{html.escape(name)}">{html.escape(name)}</a></li>' for name in listing)
    index.write_text(f"<!doctype html><meta charset=utf-8><title>tests</title><ul>{items}</ul>")


_DRAWN: dict[str, tuple[Path, list[dict]]] = {}  # lesson folder -> (drawn files, figures)


def lesson_figures(lesson: dict, out: Path) -> list[dict]:
    """Draw a lesson's figures with its own figures.py (once per process: a second build copies
    them) into the site's figures folder for the lesson. Returns [{"src" (relative to a lesson
    page), "alt", "caption"}]."""
    folder = REPO_ROOT / lesson["folder"]
    if not (folder / "figures.py").exists():
        return []
    if lesson["folder"] not in _DRAWN:
        module = importlib.import_module(lesson["folder"].replace("/", ".") + ".figures")
        drawn_dir = Path(tempfile.mkdtemp(prefix="dtfs-figures-"))
        try:
            figures = module.site_figures(drawn_dir)
        except Exception as exc:  # the lesson's own drawing code failed: say which lesson
            raise SiteError(f"{lesson['folder']}/figures.py: site_figures failed: {exc!r}") from exc
        for figure in figures:
            path = drawn_dir / figure["file"]
            if not path.exists() or path.stat().st_size == 0 or not figure.get("alt"):
                raise SiteError(f"{lesson['folder']}/figures.py: {figure.get('file')!r} was not "
                                f"drawn or has no alt text")
        _DRAWN[lesson["folder"]] = (drawn_dir, figures)
    drawn_dir, figures = _DRAWN[lesson["folder"]]
    target = out / "lessons" / "figures" / lesson["id"]
    target.mkdir(parents=True, exist_ok=True)
    for figure in figures:
        shutil.copy(drawn_dir / figure["file"], target / figure["file"])
    return [{"src": f"figures/{lesson['id']}/{figure['file']}", "alt": figure["alt"],
             "caption": figure.get("caption", "")} for figure in figures]


def lesson_exercise_rows(lesson: dict) -> list[dict]:
    from lessons._exercises import lesson_exercises
    return [{"id": e.id, "title": e.title, "points": e.points, "hint": e.hint,
             "targets": e.targets} for e in lesson_exercises(REPO_ROOT / lesson["folder"])]


def build_site(out: Path, catalog: dict | None = None, npm_dir: Path = NPM_CACHE) -> list[Path]:
    """Build the whole site into `out` (emptied first). Returns the HTML pages written.
    Raises SiteError on a broken internal link."""
    catalog = catalog or load_catalog()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    copy_assets(out, vendor_assets(npm_dir))
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    lessons = catalog["lessons"]
    titles = {lesson["id"]: lesson["title"] for lesson in lessons}
    pages = []
    (out / "lessons").mkdir()
    for position, lesson in enumerate(lessons):
        copy_sources(out, lesson)
        links = lesson_links(lesson)
        readme = (REPO_ROOT / lesson["paths"]["docs"]).read_text()
        sibling_links = {name: f"../src/{lesson['folder']}/{name}" for name in lesson_files(lesson)}
        body, toc = render_markdown(readme, {**sibling_links, "main.py": links["script"],
                                             "quiz.json": links["quiz"]})
        quiz = json.loads((REPO_ROOT / lesson["paths"]["quiz"]).read_text())
        page = out / "lessons" / f"{lesson['id']}-{lesson['slug']}.html"
        previous = lessons[position - 1] if position else None
        following = lessons[position + 1] if position + 1 < len(lessons) else None
        figures = lesson_figures(lesson, out)
        exercises = lesson_exercise_rows(lesson)
        page.write_text(env.get_template("lesson.html").render(
            course=catalog, lesson=lesson, body=body, toc=toc, links=links, titles=titles,
            figures=figures, exercises=exercises,
            quiz_json=json.dumps(quiz).replace("</", "<\\/"), previous=previous,
            following=following, root=".."))
        pages.append(page)
    index = out / "index.html"
    index.write_text(env.get_template("index.html").render(course=catalog, lessons=lessons,
                                                           titles=titles, root="."))
    pages.append(index)
    broken = check_links(out)
    if broken:
        raise SiteError("broken internal links:\n" + "\n".join(broken))
    return pages


# ----------------------------------------------------------------------------- link check


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.links.append(value)
            if name == "id" and value:
                self.ids.add(value)


def check_links(out: Path) -> list[str]:
    """Every relative href/src of every page must name an existing file (and, with #anchor, an
    id on the target page). External links are not allowed in an offline site."""
    parsed: dict[Path, _Links] = {}

    def parse(path: Path) -> _Links:
        if path not in parsed:
            parser = _Links()
            parser.feed(path.read_text(errors="replace"))
            parsed[path] = parser
        return parsed[path]

    broken = []
    for page in sorted(out.rglob("*.html")):
        for link in parse(page).links:
            parts = urlsplit(link)
            if parts.scheme in ("http", "https") or link.startswith("//"):
                broken.append(f"{page.relative_to(out)}: external link {link} (the site is offline)")
                continue
            if parts.scheme:  # mailto:, data:, javascript:
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists() or not target.is_relative_to(out.resolve()):
                broken.append(f"{page.relative_to(out)}: {link} -> missing")
            elif parts.fragment and target.suffix == ".html" and \
                    unquote(parts.fragment) not in parse(target).ids:
                broken.append(f"{page.relative_to(out)}: {link} -> no id '{parts.fragment}'")
    return broken
