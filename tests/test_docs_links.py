"""Every relative link and image of README.md and docs/ resolves: the file exists and, with a
#fragment, the heading does. Runs without MkDocs, so a README link to a missing page fails CI on
every leg (the strict site build of tests/test_docs.py checks docs/ a second time)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from doc_pages import ROOT, outside_code, pages

INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
SITE_RESULTS = "docs/results/"  # docs/hooks.py serves benchmarks/results/*.png there


def slug(title: str) -> str:
    """A heading's anchor, as MkDocs' toc and GitHub make it for plain headings."""
    text = re.sub(r"<[^>]+>|[`*]", "", title)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page's headings (a repeated one gets -1, -2...)."""
    found, seen = set(), {}
    for line in outside_code(path, keep_code_spans=True).splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def targets(path: Path) -> list[str]:
    text = outside_code(path)
    return INLINE.findall(text) + REFERENCE.findall(text) + HTML.findall(text)


def resolve(page: Path, target: str, root: Path) -> Path:
    resolved = (page.parent / target).resolve()
    relative = (
        resolved.relative_to(root.resolve()).as_posix()
        if resolved.is_relative_to(root.resolve())
        else ""
    )
    if not resolved.exists() and relative.startswith(SITE_RESULTS):
        return root / "benchmarks" / "results" / relative[len(SITE_RESULTS) :]
    return resolved


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """'page: target (why)' for each relative link of `page` that does not resolve."""
    broken = []
    for target in targets(page):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or target.startswith("mailto:"):
            continue  # absolute URLs are not checked here (CI has no network)
        file = resolve(page, unquote(parts.path), root) if parts.path else page
        name = page.relative_to(root).as_posix()
        if not file.exists():
            broken.append(f"{name}: {target} (no such file)")
        elif parts.fragment and file.suffix == ".md" and parts.fragment not in anchors(file):
            broken.append(f"{name}: {target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_readme_links_every_docs_page():
    readme = {resolve(ROOT / "README.md", t, ROOT) for t in targets(ROOT / "README.md")}
    missing = [p.name for p in pages()[1:] if p.name != "index.md" and p not in readme]
    assert missing == []


def test_a_readme_link_to_a_missing_page_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Deep part\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/guide.md#deep-part) [gone](docs/missing.md) [bad](docs/guide.md#nope)\n"
        "`[in code](docs/nowhere.md)`\n```\n[in a block](docs/nowhere.md)\n```\n"
        "![plot](benchmarks/none.png) [web](https://example.org/x.md)\n"
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: docs/guide.md#nope (no heading with that anchor)",
        "README.md: benchmarks/none.png (no such file)",
    ]


def test_anchors_follow_the_slug_rules():
    assert slug("`lerp_`: one call, many tensors") == "lerp_-one-call-many-tensors"
    assert slug("An `nn.Module`, as timm's `ModelEmaV3` is") == "an-nnmodule-as-timms-modelemav3-is"
