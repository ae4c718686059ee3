"""The documentation: a README short enough to read, links that lead somewhere, no unpublished sources."""

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_LIMIT = 12_000
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(text: str) -> str:
    """The text a reader sees as Markdown: code blocks and code spans hold no links or headings."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: Counter[str] = Counter()
    anchors = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


@pytest.mark.parametrize("readme", ["README.md", "benchmarks/README.md"])
def test_readme_is_short(readme):
    """The front page, and the benchmarks' page of today's figures (their history is in git)."""
    size = len((REPO / readme).read_text())
    assert size <= README_LIMIT, f"{readme} has {size} characters (at most {README_LIMIT}): move reference to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_to_files_and_headings(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_cite_only_what_the_repository_holds(page):
    # The design document was never part of the repository: a reader cannot follow a reference to it.
    assert "DESIGN" not in page.read_text(), f"{page.relative_to(REPO)} refers to DESIGN, which is not in the repo"
