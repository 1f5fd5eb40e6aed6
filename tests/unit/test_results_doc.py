"""benchmarks/RESULTS.md stays a page of current figures: every headline figure links to a
section of the file that exists and carries its date."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_headline_figure_links_to_a_section_and_names_its_date() -> None:
    text = RESULTS.read_text()
    anchors = {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    headline = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in headline.splitlines() if line.startswith("| ")][1:]
    assert rows, "no headline figures"
    for row in rows:
        links = re.findall(r"\]\(#([^)]+)\)", row)
        assert links, f"a headline figure without a link to its section: {row}"
        assert all(link in anchors for link in links), f"no section for {links}: {row}"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", row), f"a headline figure without its date: {row}"
