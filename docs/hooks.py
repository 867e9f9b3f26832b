"""MkDocs hooks for `make docs`.

- experiments/README.md (written by `python -m paged.report.index`) and experiments/results/ (the
  PNGs and tables it links to) are added to the site under experiments/, so the paper's results
  live in one place and strict mode checks their links like any other page's.
- Two sources that would build to the same page (docs/experiments.md and experiments/README.md
  both become experiments/index.html) are a warning, so strict mode fails instead of one page
  silently replacing the other.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from mkdocs.structure.files import File, Files

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
log = logging.getLogger("mkdocs.hooks.paged")


def on_files(files: Files, config) -> Files:
    sources = [EXPERIMENTS / "README.md"]
    results = EXPERIMENTS / "results"
    if results.is_dir():
        sources += sorted(p for p in results.rglob("*") if p.is_file())
    for path in sources:
        uri = "experiments/" + path.relative_to(EXPERIMENTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    for dest, n in Counter(f.dest_uri for f in files).items():
        if n > 1:
            clash = ", ".join(f.src_uri for f in files if f.dest_uri == dest)
            log.warning(f"{clash} all build to {dest}; rename one")
    return files
