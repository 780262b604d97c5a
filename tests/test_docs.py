"""The documentation site builds strictly (mkdocs.yml: a broken link, anchor or reference, a page
left out of the nav, a docstring mkdocstrings cannot parse each fail it) without importing torch
or the compiled extension, and the docs tools pinned in pyproject are the ones .ci/env.sh installs.
Skipped, saying why, where MkDocs is not installed, except in CI (CI=true), where that fails."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from doc_pages import ROOT

# The build runs with these made unimportable: the API reference is read from the source.
BLOCKED = ("torch", "fused_ema._C")
MKDOCS = f"import sys; sys.modules.update(dict.fromkeys({BLOCKED!r}))\n" + (
    "from mkdocs.__main__ import cli; cli()"
)


def require_mkdocs():
    missing = [
        name
        for name in ("mkdocs", "mkdocstrings_handlers.python", "pymdownx")
        if importlib.util.find_spec(name.split(".")[0]) is None
    ]
    if not missing:
        return
    why = f"{', '.join(missing)} not installed (pip install -e .[docs], or .ci/env.sh)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must build the docs: {why}")
    pytest.skip(why)


def mkdocs_build(config, site, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-c", MKDOCS, "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strictly_without_torch(tmp_path):
    require_mkdocs()
    site = tmp_path / "site"
    built = mkdocs_build(ROOT / "mkdocs.yml", site)
    log = built.stdout + built.stderr
    assert built.returncode == 0, log
    assert "WARNING" not in log and "ERROR" not in log, log
    api = (site / "api" / "index.html").read_text()
    for name in ("fused_ema.ModelEma.update", "fused_ema.lerp_many_", "fused_ema.PostHocEma"):
        assert f'id="{name}"' in api, f"{name} is missing from the generated API reference"
    plots = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.png")}
    assert plots and plots <= {p.name for p in (site / "results").iterdir()}


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """mkdocs.yml's own validation settings, on a page with a broken link and one with a broken
    anchor: each must fail the build (not just log at INFO, MkDocs' default for some)."""
    require_mkdocs()
    import yaml  # a dependency of mkdocs

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Part\n")
    for name, link in {"page": "missing.md", "anchor": "index.md#no-such-part"}.items():
        (docs / "extra.md").write_text(f"# Extra\n\n[a link]({link})\n")
        small = {key: config[key] for key in ("site_name", "strict", "validation")}
        small.update(docs_dir=str(docs), nav=["index.md", "extra.md"])
        (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
        built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site", cwd=tmp_path)
        assert built.returncode != 0, f"a broken {name} link passed:\n{built.stderr}"
        assert link in built.stderr


def test_the_docs_tools_pinned_in_pyproject_are_those_ci_installs():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^docs = \[(.*?)\]", pyproject, re.M | re.S)
    pinned = sorted(re.findall(r'"([^"]+)"', extra.group(1)))
    env = re.search(r'fused_ema_docs_tools="([^"]*)"', (ROOT / ".ci" / "env.sh").read_text())
    assert pinned and all("==" in p for p in pinned)
    assert sorted(env.group(1).split()) == pinned
