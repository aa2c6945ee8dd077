"""Every relative link in docs/ and README.md resolves: its file exists, and its #anchor is a
heading of that page as GitHub spells it. Pages move as the docs are reorganised; a link left
pointing at the old place should fail here, not on a reader."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
MAX_LINES = 500

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a `#` there is a shell comment)."""
    lines, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[*_`]", lambda m: "_" if m.group() == "_" else "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    counts: dict[str, int] = {}
    found = set()
    for line in prose_lines(page):
        if match := HEADING.match(line):
            base = slug(match.group(2))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)  # GitHub's second "x" is "x-1"
    return frozenset(found)


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose_lines(page), 1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"no such file {resolved.relative_to(ROOT) if ROOT in resolved.parents else path}"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"no heading #{anchor} in {resolved.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    problems = [
        f"{page.relative_to(ROOT)}:{number}: ({target}) {why}"
        for number, target in links(page)
        if (why := broken(page, target))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_length(page: Path) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{page.relative_to(ROOT)} is {lines} lines (at most {MAX_LINES})"


def test_slug_follows_github() -> None:
    assert slug("A fleet behind vLLM's router (`bench/fleet.py`)") == (
        "a-fleet-behind-vllms-router-benchfleetpy"
    )
    assert slug("Prefix-cache hits (`cached_tokens`)") == "prefix-cache-hits-cached_tokens"
    assert slug("Overload at 10x capacity") == "overload-at-10x-capacity"
