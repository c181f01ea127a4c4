"""The documentation site builds with `mkdocs build --strict`, and its pages carry no reST.

The API reference is rendered by mkdocstrings from the docstrings, which it reads as Google
style with Markdown. reST written there reaches the page raw: a role (`:func:`), a literal
block's `::`, a doctest (`>>>` lines become nested quotes). The built pages' text, outside
code, must hold none of them, nor the name of a private class, nor an overload's stubs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (it comes with the docs extra)")
pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the docs extra)")

ROOT = Path(__file__).parent.parent
ROLE = re.compile(r":(?:py:)?(?:func|meth|class|attr|mod|exc|data|obj|ref|const|type):")
PRIVATE = ("BuiltinLimiter", "TypedLimiter", "_Unset", "_UNSET")


class PageText(HTMLParser):
    """A page's text outside code, scripts and styles."""

    OPAQUE = frozenset({"script", "style", "code", "pre"})

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.OPAQUE:
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.OPAQUE:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if not self._depth:
            self.parts.append(data)


def text_of(html: str) -> str:
    parser = PageText()
    parser.feed(html)
    return " ".join(parser.parts)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return out


def pages(site: Path) -> dict[str, str]:
    found = {
        str(path.relative_to(site)): path.read_text(encoding="utf-8")
        for path in sorted(site.rglob("*.html"))
        if path.name != "404.html"
    }
    assert "reference/api/index.html" in found
    return found


def test_no_page_shows_a_sphinx_role_or_a_rest_literal_block(site: Path) -> None:
    problems = {}
    for name, html in pages(site).items():
        text = text_of(html)
        found = ROLE.findall(text) + [
            text[max(0, m.start() - 30) : m.end() + 10] for m in re.finditer("::", text)
        ]
        if found:
            problems[name] = found
    assert not problems


def test_no_page_shows_a_doctest_as_a_quote(site: Path) -> None:
    quoted = [name for name, html in pages(site).items() if "<blockquote>\n<blockquote>" in html]
    assert not quoted


def test_the_reference_hides_private_classes_and_overload_stubs(site: Path) -> None:
    for name, html in pages(site).items():
        if not name.startswith("reference/"):
            continue
        # An overload stub's defaults are `...`: a signature never shows `= ...`.
        everything = re.sub(r"<[^>]+>", "", html)
        assert not re.search(r" = \.\.\.[,)]", everything), name
        for private in PRIVATE:
            assert private not in html, (name, private)
        for bases in re.findall(r"Bases: (.*?)</p>", html, re.DOTALL):
            shown = re.sub(r"<[^>]+>|\s", "", bases).split(",")
            hidden = [b for b in shown if b.startswith(("_", "Generic["))]
            assert not hidden, (name, hidden)


def test_the_reference_documents_every_public_name(site: Path) -> None:
    import slotwise

    html = pages(site)["reference/api/index.html"]
    missing = [name for name in slotwise.__all__ if f'id="slotwise.{name}"' not in html]
    assert not missing
