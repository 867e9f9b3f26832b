"""`python -m paged.report.index [experiments/results] [--out experiments/README.md]`: one page with
every experiment's report (its table.md and plots), in paper order, headed by a scoreboard of
the comparisons with the paper. Regenerate it after re-running any experiment."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from paged.utils.atomic_file import OutputError, write_text

HEADER = """# Experiments: the PagedAttention paper, regenerated

Every section below is written by one command, `python run.py -m +experiment=NAME
report.publish=true` (presets in `conf/experiment/`): the sweep runs, its report (`python -m paged.report`) writes
`experiments/results/NAME/{results.csv, aggregate.csv, table.md, *.png}`, and this page is
regenerated with `python -m paged.report.index`. GPU numbers are the simulator's (`executor=sim`,
the paper's servers in `conf/setup/`); no GPU was used. The `cpu-*` experiments run the real
SmolLM2-135M on this machine against the simulator calibrated on it.
"""


def _order(path: Path) -> tuple:
    """table1, fig2, fig12-*, fig13 ... (by figure number), then the cpu-* and bench-* studies."""
    name = path.name
    kind = 0 if name.startswith("table") else 1 if name.startswith("fig") else 2 if name.startswith("cpu") else 3
    number = re.match(r"[a-z]+(\d+)", name)
    return (kind, int(number.group(1)) if number else 0, name)


def _verdicts(table: str) -> tuple[int, int]:
    section = table.split("## Against the paper", 1)[1] if "## Against the paper" in table else ""
    section = section.split("\n## ", 1)[0]
    return section.count("| within |"), section.count("| OUTSIDE |")


def build_index(results: Path) -> str:
    sections, board = [], ["| experiment | within the paper's tolerance | outside |", "|---|---|---|"]
    for folder in sorted((p for p in results.iterdir() if (p / "table.md").is_file()), key=_order):
        table = (folder / "table.md").read_text()
        title, _, body = table.partition("\n")
        within, outside = _verdicts(table)
        if within or outside:
            board.append(f"| [{folder.name}](#{folder.name}) | {within} | {outside} |")
        # the report's images sit next to its table.md; from here they are under results/NAME/
        body = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", rf"![\1](results/{folder.name}/\2)", body)
        body = body.replace("\n## ", "\n### ")
        body = re.sub(r"^(\d+ configurations) from `[^`]*`", r"\1", body, flags=re.M)
        sections.append(f'<a id="{folder.name}"></a>\n## {title.lstrip("# ")}\n\n'
                        f"`python run.py -m +experiment={folder.name}`\n{body}")
    return "\n".join([HEADER, *board, "", *sections])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged.report.index", description=__doc__)
    parser.add_argument("results", type=Path, nargs="?", default=Path("experiments/results"))
    parser.add_argument("--out", type=Path, default=None, help="default: README.md beside the results folder")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        print(f"error: {args.results}: not a folder (the experiments' results, e.g. experiments/results)",
              file=sys.stderr)
        return 2
    out = args.out or args.results.parent / "README.md"
    try:
        write_text(out, build_index(args.results))
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
