"""mkdocs hook: serve the benchmark plots that docs/benchmarks.md shows.

The page links its plots as ``../bench/results/NAME.png`` so that the links work on GitHub;
mkdocs only serves files under docs/, so this hook adds ``bench/results/*.png`` to the site as
``bench/results/NAME.png`` and rewrites those links on the page to point there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PLOTS = "bench/results"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted((ROOT / PLOTS).glob("*.png")):
        files.append(File.generated(config, f"{PLOTS}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == "benchmarks.md":
        markdown = markdown.replace(f"](../{PLOTS}/", f"]({PLOTS}/")
    return markdown
