"""The documentation's links resolve: every relative link in README.md and docs/*.md names
a file that exists, and every #anchor a heading of the page it points into (anchors made
as GitHub makes them). Prose stays wrapped and tables readable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced and indented code blocks."""
    out, fenced, indented, previous_blank = [], False, False, True
    for number, line in enumerate(text.splitlines(), 1):
        blank = not line.strip()
        if indented and not blank and not line.startswith("    "):
            indented = False  # the first unindented line ends an indented code block
        if not fenced and not indented and line.startswith("    ") and previous_blank:
            indented = True
        if indented:
            continue  # blank lines inside an indented block belong to it
        if _FENCE.match(line.lstrip()):
            fenced, previous_blank = not fenced, False
            continue
        if fenced:
            continue
        previous_blank = blank
        out.append((number, line))
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped (link text kept), lower case,
    anything but letters, digits, spaces, hyphens and underscores removed, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in prose_lines(path.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside code."""
    lines = prose_lines(path.read_text())
    text = "\n".join(line for _, line in lines)
    text = re.sub(r"`[^`\n]*`", lambda m: "`" + "x" * (len(m.group()) - 2) + "`", text)  # code spans
    numbers = [n for n, _ in lines]
    out = []
    for m in _LINK.finditer(text):
        out.append((numbers[text.count("\n", 0, m.start())], m.group(2)))
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with that anchor in {dest.relative_to(root)}")
    return problems


def test_github_anchors():
    assert github_anchor("Serving: `nanokv serve`") == "serving-nanokv-serve"
    assert github_anchor("scripts/gpu_check.sh") == "scriptsgpu_checksh"
    assert github_anchor("A request's path") == "a-requests-path"
    assert github_anchor("int8 and fp8 KV cache") == "int8-and-fp8-kv-cache"
    assert github_anchor("See [the API](api.md)") == "see-the-api"


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n\n[ok](#two-words) [ok](b.md#x)\n"
                                   "[bad](#three-words) [bad](c.md) [bad](b.md#y)\n\n"
                                   "    [ignored](in-code.md)\n\n```\n[ignored](fenced.md)\n```\n"
                                   "`[ignored](span.md)` [web](https://example.com)\n")
    (tmp_path / "b.md").write_text("# X\n")
    problems = broken_links(tmp_path / "a.md", tmp_path)
    assert [p.split(": ")[1] for p in problems] == ["#three-words", "c.md", "b.md#y"]


def test_duplicate_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Notes\n\n## Notes\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    assert broken_links(page) == []


def test_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {target.partition("#")[0] for _, target in links(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, sorted(pages - listed)


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_lines_are_readable(page):
    """Prose wrapped near 90 columns; a table row at most 250 characters."""
    long = []
    for number, line in prose_lines(page.read_text()):
        limit = 250 if line.lstrip().startswith("|") else 100
        if len(line) > limit and not re.search(r"\]\([^)]*\)\s*$", line):  # a link's target cannot wrap
            long.append(f"{page.name}:{number}: {len(line)} characters")
    assert long == []
