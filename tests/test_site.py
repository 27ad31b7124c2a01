"""The learner site, built from catalog.json and driven in a real headless Chromium (playwright
with the system browser; CI installs it and sets COURSE_REQUIRE_BROWSER=1 so it cannot skip).
The lessons' figures are drawn in quick mode (COURSE_QUICK=1, as the notebooks' test does): a
figure that trains or benchmarks draws the same picture from a shorter run; `python -m course
site` draws the full ones."""

from __future__ import annotations

import copy
import functools
import http.server
import json
import os
import shutil
import tempfile
import threading
import unittest
from pathlib import Path
from unittest import mock

from course import load_catalog
from course import site as site_module

CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]

_QUICK = mock.patch.dict(os.environ, {"COURSE_QUICK": "1"})


def setUpModule():
    _QUICK.start()


def tearDownModule():
    _QUICK.stop()


def require_npm_or_cache() -> None:
    """Building needs mermaid and KaTeX: npm installs them once into .cache/site-npm. Without
    npm the site tests skip, except in CI (COURSE_REQUIRE_BROWSER), where that is a failure."""
    cached = (site_module.NPM_CACHE / "node_modules" / "mermaid").exists()
    if shutil.which("npm") is None and not cached:
        if os.environ.get("COURSE_REQUIRE_BROWSER"):
            raise AssertionError("COURSE_REQUIRE_BROWSER is set but npm is missing")
        raise unittest.SkipTest("npm is needed once to build the site (install Node.js)")


def require_browser(case: unittest.TestCase) -> None:
    if CHROMIUM is None:
        if os.environ.get("COURSE_REQUIRE_BROWSER"):
            case.fail("COURSE_REQUIRE_BROWSER is set but no chromium was found")
        case.skipTest("no system chromium (CI installs it)")


class TestSiteBuild(unittest.TestCase):
    def setUp(self):
        require_npm_or_cache()

    def test_broken_internal_link_fails_the_build(self):
        original = site_module.render_markdown

        def with_broken_link(text, link_map):
            body, toc = original(text, link_map)
            return body + '<a href="no-such-page.html">oops</a>', toc

        # one lesson's site is enough to carry the broken link (the whole course's is built
        # and link-checked below)
        catalog = copy.deepcopy(load_catalog())
        catalog["lessons"] = catalog["lessons"][:1]
        with tempfile.TemporaryDirectory() as tmp, \
                mock.patch.object(site_module, "render_markdown", with_broken_link):
            with self.assertRaisesRegex(site_module.SiteError, "no-such-page.html -> missing"):
                site_module.build_site(Path(tmp) / "out", catalog)

    def test_link_checker_catches_missing_anchor_and_external_links(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            (out / "a.html").write_text('<h2 id="here">x</h2><a href="#here">ok</a>'
                                        '<a href="#gone">bad</a><a href="https://example.org/">ext</a>')
            broken = "\n".join(site_module.check_links(out))
        self.assertIn("no id 'gone'", broken)
        self.assertIn("external link", broken)
        self.assertNotIn("#here ->", broken)

    def test_a_new_catalog_lesson_appears_with_no_other_change(self):
        # the first lesson and the new one (the whole course's site is built once, below)
        catalog = copy.deepcopy(load_catalog())
        extra = copy.deepcopy(catalog["lessons"][0])
        extra.update(id="99", slug="extra_lesson", title="A lesson added to the catalog only")
        catalog["lessons"] = [catalog["lessons"][0], extra]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            site_module.build_site(out, catalog)
            index = (out / "index.html").read_text()
            self.assertTrue((out / "lessons" / "99-extra_lesson.html").exists())
        self.assertIn("A lesson added to the catalog only", index)
        self.assertIn('data-lesson="99"', index)


class TestSiteInBrowser(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_npm_or_cache()
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = Path(cls.tmp.name) / "site"
        cls.pages = site_module.build_site(cls.out)
        handler = functools.partial(_QuietHandler, directory=str(cls.out))
        cls.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=cls.server.serve_forever, daemon=True).start()
        cls.base = f"http://127.0.0.1:{cls.server.server_address[1]}"
        cls.playwright = cls.browser = None
        if CHROMIUM:
            from playwright.sync_api import sync_playwright
            cls.playwright = sync_playwright().start()
            cls.browser = cls.playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)

    @classmethod
    def tearDownClass(cls):
        if cls.browser:
            cls.browser.close()
        if cls.playwright:
            cls.playwright.stop()
        cls.server.shutdown()
        cls.server.server_close()
        cls.tmp.cleanup()

    def setUp(self):
        require_browser(self)
        self.context = self.browser.new_context()
        self.addCleanup(self.context.close)

    def open(self, relative: str):
        """A new tab on the built page, once its diagrams are rendered; (page, its errors)."""
        page = self.context.new_page()
        errors = _watch(page)
        self.go(page, relative)
        return page, errors

    def go(self, page, relative: str) -> None:
        page.goto(f"{self.base}/{relative}")
        page.wait_for_selector("body[data-mermaid=done]", state="attached", timeout=60_000)

    def visit_every_page(self) -> dict[str, dict]:
        """Each built page loaded once (a page's diagrams take seconds to render): its console
        errors, mermaid blocks and their SVGs, each figure (src, natural width, alt) after it
        was scrolled into view and finished loading, and the lesson cards it lists (the
        data-lesson of each, in order). Shared by the three tests below. One tab
        visits them all, a navigation each (a new document: nothing of the last page's scripts
        survives): a new tab per page cost 4 CPU seconds a page (a fresh renderer compiles
        mermaid.min.js again), a navigation 1."""
        cls = type(self)
        if not hasattr(cls, "_visits"):
            visits = {}
            page = self.context.new_page()
            errors = _watch(page)
            for path in self.pages:
                relative = path.relative_to(self.out).as_posix()
                errors.clear()
                self.go(page, relative)
                images = page.locator("#figures img")
                figures = []
                for index in range(images.count()):
                    image = images.nth(index)
                    image.scroll_into_view_if_needed()
                    page.wait_for_function("img => img.complete", arg=image.element_handle())
                    figures.append((image.get_attribute("src"), image.evaluate("img => img.naturalWidth"),
                                    image.get_attribute("alt")))
                cards = page.locator("li.lesson-card").evaluate_all("els => els.map(e => e.dataset.lesson)")
                visits[relative] = {"errors": list(errors), "blocks": page.locator("pre.mermaid").count(),
                                    "svgs": page.locator("pre.mermaid svg").count(), "figures": figures,
                                    "cards": cards}
            page.close()
            cls._visits = visits
        return cls._visits

    def test_every_page_loads_clean_and_every_mermaid_block_is_an_svg(self):
        for relative, visit in self.visit_every_page().items():
            with self.subTest(page=relative):
                self.assertEqual(visit["errors"], [])
                self.assertEqual(visit["svgs"], visit["blocks"])
                if relative.startswith("lessons/"):
                    self.assertGreater(visit["blocks"], 0, "a lesson page without a diagram")

    def test_every_lesson_figure_loads_with_alt_text(self):
        drawing = [lesson for lesson in load_catalog()["lessons"]
                   if (site_module.REPO_ROOT / lesson["folder"] / "figures.py").exists()]
        self.assertGreater(len(drawing), 0, "no lesson draws a figure for the site")
        visits = self.visit_every_page()
        for lesson in drawing:
            with self.subTest(lesson=lesson["id"]):
                figures = visits[f"lessons/{lesson['id']}-{lesson['slug']}.html"]["figures"]
                self.assertGreater(len(figures), 0)
                for src, width, alt in figures:
                    self.assertGreater(width, 0, src)
                    self.assertTrue(alt, f"{src}: no alt text")

    def test_index_lists_every_catalog_lesson_in_order(self):
        ids = self.visit_every_page()["index.html"]["cards"]
        self.assertEqual(ids, [lesson["id"] for lesson in load_catalog()["lessons"]])

    def test_quiz_feedback_score_progress_and_reset(self):
        lesson = load_catalog()["lessons"][0]
        quiz = json.loads((site_module.REPO_ROOT / lesson["paths"]["quiz"]).read_text())
        total = len(quiz["questions"])
        page, errors = self.open(f"lessons/{lesson['id']}-{lesson['slug']}.html")
        first = quiz["questions"][0]
        wrong = next(i for i, o in enumerate(first["options"]) if not o["correct"])
        form = page.locator(f"form[data-id='{first['id']}']")
        form.locator("input").nth(wrong).check()
        form.locator("button").click()
        feedback = form.locator(".feedback").inner_text()
        self.assertIn("Not quite.", feedback)
        self.assertIn(first["options"][wrong]["explanation"], feedback)
        self.assertIn(f"Score: 0 / {total} (1 answered)", page.locator("#quiz-score").inner_text())

        numeric = next(q for q in quiz["questions"] if q["type"] == "numeric")
        form = page.locator(f"form[data-id='{numeric['id']}']")
        # within the tolerance, not the exact value, when the tolerance allows it
        form.locator("input").fill(str(numeric["answer"] + numeric["tolerance"] / 2))
        form.locator("button").click()
        self.assertIn("Correct!", form.locator(".feedback").inner_text())
        self.assertIn(f"Score: 1 / {total} (2 answered)", page.locator("#quiz-score").inner_text())

        page.reload()  # progress survives a reload (localStorage) and shows on the index
        page.wait_for_selector("body[data-mermaid=done]", state="attached")
        self.assertIn(f"Score: 1 / {total} (2 answered)", page.locator("#quiz-score").inner_text())
        index, _ = self.open("index.html")
        progress = index.locator(f"[data-progress-for='{lesson['id']}']").inner_text()
        self.assertEqual(progress, f"quiz: 2/{total} answered, 1 correct")
        page.locator("#quiz-reset").click()
        self.assertIn(f"Score: 0 / {total} (0 answered)", page.locator("#quiz-score").inner_text())
        self.assertEqual(errors, [])


def _watch(page) -> list[str]:
    """The list the page's console errors and uncaught exceptions are appended to."""
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


if __name__ == "__main__":
    unittest.main()
