"""Figures live on one page per topic (bench/results/), and the dated notebook keeps the history.

Every section of bench/NOTEBOOK.md has a title of its own and is listed on a topic page; every
title a page quotes is a section there; and nothing cites the notebook by a section's position
or the old single results page.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "bench" / "NOTEBOOK.md"
PAGES = sorted((ROOT / "bench" / "results").glob("*.md"))
# Where a doc, a docstring, a config or a bench names a results page.
CITING = [p for pattern in ("*.md", "occamy_mtp/**/*.py", "bench/*.py", "bench/*.sh", "configs/*.yaml", "scripts/*.sh", "tests/*.py")
          for p in ROOT.glob(pattern) if p != NOTEBOOK and "results" not in p.parts]
CITING += sorted((ROOT / "docs").rglob("*.md"))


def notebook_titles(text: str) -> list[str]:
    return [line[3:].strip() for line in text.splitlines() if line.startswith("## ")]


def quoted_titles(text: str) -> set[str]:
    """The notebook sections a page quotes: its History list and its "notebook section" citations."""
    listed = {m.group(1) for m in re.finditer(r'^- "(.+?)"', text, re.M)}
    cited = {m.group(1) for m in re.finditer(r'notebook sections? "([^"]+)"', " ".join(text.split()))}
    return listed | cited


def test_every_notebook_section_has_a_title_of_its_own():
    titles = notebook_titles(NOTEBOOK.read_text())
    assert len(titles) > 60 and len(set(titles)) == len(titles), [t for t in titles if titles.count(t) > 1]


def test_every_page_quotes_sections_that_exist_and_every_section_is_on_a_page():
    titles = set(notebook_titles(NOTEBOOK.read_text()))
    index = (ROOT / "bench" / "results" / "README.md").read_text()
    quoted: set[str] = set()
    for page in PAGES:
        if page.name != "README.md":
            assert f"`{page.name}`" in index, f"{page.name} is not in bench/results/README.md"
        found = quoted_titles(page.read_text())
        assert not found - titles, f"{page.name} quotes sections the notebook lacks: {sorted(found - titles)}"
        quoted |= found
    assert titles - quoted == set(), f"notebook sections on no topic page: {sorted(titles - quoted)}"


def test_the_checks_find_a_missing_section():
    assert quoted_titles('- "A run"\nsee notebook section "Another\n run" for it') == {"A run", "Another run"}


def _positional(text: str) -> list[str]:
    return re.findall(r"RESULTS\.md|the (?:last|latest|previous|next|first) (?:\"[^\"]*\" )?sections?\b|sections? (?:above|below)",
                      " ".join(text.split()))


def test_nothing_cites_a_results_section_by_position_or_the_old_page():
    found = {str(p.relative_to(ROOT)): _positional(p.read_text()) for p in CITING if p.name != "test_results_pages.py"}
    assert {path: hits for path, hits in found.items() if hits} == {}


def test_the_position_check_finds_one():
    assert _positional("see bench/RESULTS.md, the last \"Real engine\" section") == ["RESULTS.md", 'the last "Real engine" section']
