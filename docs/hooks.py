"""MkDocs hook (mkdocs.yml `hooks:`): the plots of benchmarks/results/ become site files under
results/, so the pages show the committed images without a second copy in docs/."""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files, config):
    for image in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{image.name}", abs_src_path=str(image)))
    return files
