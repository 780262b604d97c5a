"""The documentation's Markdown pages (README.md and docs/**/*.md) and their fenced code blocks,
each with the `<!-- not run: REASON -->` marker that may stand right before it: what
tests/test_docs_examples.py runs and tests/test_docs_links.py reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
PYTHON = ("python", "py")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root, e.g. "docs/checkpoints.md"
    line: int  # the opening fence's line, from 1
    lang: str  # the info string's first word ("" when none)
    code: str
    not_run: str | None  # the marker's reason, or None

    @property
    def is_python(self) -> bool:
        return self.lang in PYTHON


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, then every Markdown page of docs/ in path order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced code blocks of one page, in order. A marker line (blank lines may follow it)
    belongs to the next block; one that is followed by anything else is an error."""
    lines = path.read_text().splitlines()
    page = path.relative_to(root).as_posix()
    found, marker, i = [], None, 0
    while i < len(lines):
        text = lines[i]
        if (match := MARKER.match(text)) is not None:
            if marker is not None:
                raise ValueError(f"{page}:{marker[0]}: a 'not run' marker with no block after it")
            marker = (i + 1, match["reason"])
        elif (match := FENCE.match(text)) is not None:
            end, code = _fenced(lines, i, match)
            found.append(
                Block(page, i + 1, (match["info"].split() or [""])[0], code, marker and marker[1])
            )
            marker, i = None, end
        elif text.strip() and marker is not None:
            raise ValueError(
                f"{page}:{marker[0]}: a 'not run' marker must stand right before a block"
            )
        i += 1
    if marker is not None:
        raise ValueError(f"{page}:{marker[0]}: a 'not run' marker with no block after it")
    return found


def _fenced(lines: list[str], start: int, opening: re.Match) -> tuple[int, str]:
    """(index of the closing fence, the block's code with the fence's indent removed)."""
    fence, indent = opening["fence"], len(opening["indent"])
    closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    body = []
    for end in range(start + 1, len(lines)):
        if closing.match(lines[end]):
            return end, "\n".join(body) + "\n"
        line = lines[end]
        body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
    raise ValueError(f"unclosed code fence at line {start + 1}")


def outside_code(path: Path, keep_code_spans: bool = False) -> str:
    """The page's text with fenced blocks blanked, and inline code spans unless kept (links are
    read here, headings with their code spans)."""
    lines = path.read_text().splitlines()
    kept, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is not None:
            end, _ = _fenced(lines, i, match)
            kept.extend([""] * (end - i + 1))
            i = end + 1
            continue
        kept.append(lines[i] if keep_code_spans else re.sub(r"(`+).*?\1", "", lines[i]))
        i += 1
    return "\n".join(kept)
