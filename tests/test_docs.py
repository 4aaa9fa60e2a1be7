"""The documentation site stays complete: every public name in the API
reference, every page in the navigation, every figure it shows on disk.
(`mkdocs build --strict` in `.ci/run` checks links and docstrings.)"""

import pathlib
import re

import solvax as sx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_api_reference_lists_every_public_name():
    listed = set(re.findall(r"^::: solvax\.(\w+)", (DOCS / "api.md").read_text(), re.M))
    assert set(sx.__all__) <= listed, set(sx.__all__) - listed
    assert listed - set(sx.__all__) == {"distributed"}


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in DOCS.glob("*.md")}
    in_nav = set(re.findall(r":\s+(\w+\.md)\s*$", config, re.M))
    assert pages == in_nav, pages ^ in_nav


def test_every_figure_shown_exists():
    shown = {m for page in DOCS.glob("*.md")
             for m in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())}
    assert shown, "the site shows no figure"
    assert all((DOCS / path).is_file() for path in shown), shown
