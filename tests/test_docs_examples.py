"""Every code example of README.md and docs/ runs: each ```python block, in page order, in one
namespace per page that starts from tests/docs_prelude.py, in a temporary folder per page. A block
marked `<!-- not run: REASON -->` and every block in another language are reported as skipped with
their reason; one that needs an optional framework that is not installed skips saying which."""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from doc_pages import ROOT, Block, blocks, pages

PRELUDE = Path(__file__).with_name("docs_prelude.py")
# Peers and frameworks an example may need; a missing one skips it (never a missing fused_ema
# module). timm stays out: `import timm` imports torchvision, which cannot load beside every torch
# of the CI matrix, so examples that import timm are marked `not run`.
OPTIONAL = {
    "accelerate",
    "diffusers",
    "ema_pytorch",
    "lightning",
    "pytorch_lightning",
    "torch_ema",
    "transformers",
}
BLOCKS = [block for page in pages() for block in blocks(page)]


@dataclass
class PageRun:
    """One page's namespace, its folder, and how far its blocks have run."""

    folder: Path
    namespace: dict = field(default_factory=dict)
    done: int = 0  # index (among the page's blocks) of the next block to run
    failed: int | None = None  # the line of a block that failed: the later ones cannot run
    missing: str | None = None  # an optional module an earlier block needed and did not find

    def run(self, block: Block) -> None:
        source = "\n" * (block.line) + block.code  # tracebacks give the Markdown file's lines
        cwd = os.getcwd()
        os.chdir(self.folder)
        try:
            exec(compile(source, block.page, "exec"), self.namespace)
        finally:
            os.chdir(cwd)


def _fresh(page: str, tmp_path_factory) -> PageRun:
    run = PageRun(tmp_path_factory.mktemp(page.replace("/", "_").replace(".", "_")))
    run.namespace["__name__"] = "__main__"  # as a script pasted from the page would see
    prelude = compile(PRELUDE.read_text(), str(PRELUDE), "exec")
    exec(prelude, run.namespace)
    return run


@pytest.fixture(scope="session")
def page_runs():
    return {}


def _missing_optional(err: BaseException) -> str | None:
    name = (getattr(err, "name", None) or "").split(".")[0]
    return name if isinstance(err, ModuleNotFoundError) and name in OPTIONAL else None


def _step(run: PageRun, block: Block) -> None:
    """Runs `block` in its page's namespace. After a block that needed a missing framework, a
    later block that fails skips naming it; after a failed block, the later ones skip."""
    if run.failed is not None:
        pytest.skip(f"an earlier block of this page (line {run.failed}) failed")
    try:
        run.run(block)
    except Exception as err:
        missing = _missing_optional(err)
        if missing:
            run.missing = missing
            pytest.skip(f"needs {missing}, which is not installed (.ci/env.sh installs it)")
        if run.missing:
            pytest.skip(
                f"an earlier block of this page needs {run.missing}, which is not installed "
                f"(here: {type(err).__name__}: {err})"
            )
        run.failed = block.line
        pytest.fail(f"{block.page}:{block.line} raised\n{traceback.format_exc()}", False)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_example_runs(block, page_runs, tmp_path_factory):
    if not block.is_python:
        pytest.skip(f"a ```{block.lang or 'text'} block: not Python, not run")
    if block.not_run:
        pytest.skip(f"marked not run: {block.not_run}")
    same_page = [b for b in BLOCKS if b.page == block.page]
    index = same_page.index(block)
    run = page_runs.get(block.page)
    if run is None or run.done > index:  # first block, or out of order (pytest -k, xdist)
        run = page_runs[block.page] = _fresh(block.page, tmp_path_factory)
    for earlier in same_page[run.done : index]:  # blocks of the page this test did not see run
        if earlier.is_python and not earlier.not_run:
            _step(run, earlier)
    run.done = index + 1
    _step(run, block)


def test_the_runner_finds_every_python_block():
    """Each page whose text has a ```python fence has that many Python blocks here, and the
    README's training loop is one that runs."""
    for page in pages():
        fences = re.findall(r"^ {0,3}```+python", page.read_text(), re.M)
        found = [b for b in BLOCKS if b.page == page.relative_to(ROOT).as_posix() and b.is_python]
        assert len(found) == len(fences), page
    readme = [b for b in BLOCKS if b.page == "README.md" and b.is_python]
    assert readme and not readme[0].not_run and "ema.update(model" in readme[0].code


def test_blocks_and_markers_are_read_as_written(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n<!-- not run: needs CUDA -->\n\n"
        '```python title="gpu"\ny = x.cuda()\n```\n\n~~~bash\nls\n~~~\n'
    )
    found = blocks(page, tmp_path)
    assert [(b.line, b.lang, b.code, b.not_run) for b in found] == [
        (2, "python", "x = 1\n", None),
        (7, "python", "y = x.cuda()\n", "needs CUDA"),
        (11, "bash", "ls\n", None),
    ]
    page.write_text("<!-- not run: nothing follows -->\nprose\n")
    with pytest.raises(ValueError, match="right before a block"):
        blocks(page, tmp_path)
    assert ROOT.joinpath("README.md").is_file()
