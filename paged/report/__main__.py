"""`python -m paged.report DIR [--out OUT]`: report a run or sweep folder (see paged/report/build.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paged.report import ReportError, build_report
from paged.report.report import preset_report
from paged.utils.atomic_file import OutputError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged.report", description=__doc__)
    parser.add_argument("dir", type=Path, help="a run or sweep folder (e.g. multirun/2026-11-23/10-00-00)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: DIR)")
    parser.add_argument("--experiment", default=None,
                        help="take the report settings from this preset as it is now, not as the jobs ran")
    args = parser.parse_args(argv)
    try:
        settings = preset_report(args.experiment) if args.experiment else None
        report = build_report(args.dir, args.out, report=settings)
    except (ReportError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report.out_dir / 'results.csv'}, table.md and {len(report.images)} plot(s)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
