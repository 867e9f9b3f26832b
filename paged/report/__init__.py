"""Sweep reports: results.csv, tables, plots and the paper comparison from a run or sweep folder."""

from paged.report.build import Report, build_report
from paged.report.collect import ReportError

__all__ = ["Report", "ReportError", "build_report"]
