"""The README stays a ten-minute read and the documentation's links stay whole: every relative
link in README.md and docs/*.md names a file of the repository, and an anchor a heading of it
(as GitHub makes anchors from headings)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without code: a `](` inside a code block or span is no link."""
    return _CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(_prose(text))


def anchors(text: str) -> set[str]:
    """GitHub's anchors: the heading lowercased, all but letters, digits, `_`, `-` and spaces
    dropped, spaces made hyphens; a repeated one gets `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)


def test_readme_is_a_ten_minute_read() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: the reference belongs in docs/"


def test_the_link_reader_finds_links_and_skips_code() -> None:
    page = ("See [http](docs/http.md#headers) and ![img](docs/img/a.png \"x\").\n"
            "`[not](a-link.md)`\n```\n[nor](this.md)\n```\n# A heading (`x.py`)\n# A heading (`x.py`)\n")
    assert links(page) == ["docs/http.md#headers", "docs/img/a.png"]
    assert anchors(page) == {"a-heading-xpy", "a-heading-xpy-1"}
    assert len(links((ROOT / "README.md").read_text(encoding="utf-8"))) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in links(text):
        if not _relative(target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
