"""The README is the front door to the manual under docs/: every relative link and image it names exists.

The manual's own links are checked by ``mkdocs build --strict`` (make test); the README lies outside
mkdocs' docs directory, so this checks it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_targets(markdown: str) -> list[str]:
    """Link and image targets that are paths in the repository (no scheme, no bare anchor)."""
    targets = (m.group(1).split("#", 1)[0] for m in LINK.finditer(markdown))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def test_readme_links_resolve() -> None:
    targets = relative_targets((ROOT / "README.md").read_text(encoding="utf-8"))
    assert any(t.startswith("docs/") and t.endswith(".md") for t in targets), "README links no docs page"
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_readme_links_every_docs_page() -> None:
    linked = {t.removeprefix("docs/") for t in relative_targets((ROOT / "README.md").read_text(encoding="utf-8"))}
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")} - {"index.md"}
    assert not pages - linked, f"docs pages the README does not link: {sorted(pages - linked)}"
