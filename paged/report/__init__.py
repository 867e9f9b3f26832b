"""Sweep reports: results.csv, tables, plots and the paper comparison from a run or sweep folder."""

from paged.report.collect import ReportError
from paged.report.report import Report, build_report

__all__ = ["Report", "ReportError", "build_report"]
