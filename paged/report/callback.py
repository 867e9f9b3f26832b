"""Hydra callback: progress while a sweep runs, and its report when it ends.

conf/config.yaml registers it (`hydra.callbacks.report`). It works with every launcher: the jobs
may run in other processes (joblib) or on other machines (submitit), so progress is counted from
the job folders on the shared file system, not from in-process state. A preset's report goes to its
`report.out` (the committed `experiments/results/NAME/`) too only with `report.publish=true`."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from paged.report.collect import ReportError
from paged.report.report import Report, build_report
from paged.report.sweep import config_sweep, group_name, num_jobs
from paged.utils.atomic_file import OutputError, write_text

log = logging.getLogger("paged.report")
PROGRESS_FILE = ".progress.json"


def _sweep_dir(config: DictConfig) -> Path:
    return Path(OmegaConf.select(config, "hydra.sweep.dir"))


class ReportCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        swept = config_sweep(config)
        sweep_dir = _sweep_dir(config)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        total = num_jobs(swept)
        write_text(sweep_dir / PROGRESS_FILE, json.dumps({"total": total, "start": time.time()}))
        log.info("sweep of %s job(s) over %s into %s", total if total is not None else "?", list(swept), sweep_dir)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not HydraConfig.initialized() or HydraConfig.get().mode.name != "MULTIRUN":
            return
        sweep_dir = Path(HydraConfig.get().sweep.dir)
        try:
            progress = json.loads((sweep_dir / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return
        jobs = [d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()]
        done = sum((d / "summary.json").is_file() for d in jobs)
        failed = sum((d / "error.json").is_file() for d in jobs)
        total, elapsed = progress["total"], time.time() - progress["start"]
        finished = done + failed
        eta = ""
        if total and finished:
            eta = f", ETA {_clock(elapsed / finished * (total - finished))}"
        log.info("sweep: %d/%s jobs done%s, %s elapsed%s", finished, total or "?",
                 f" ({failed} failed)" if failed else "", _clock(elapsed), eta)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = _sweep_dir(config)
        out = _publish_dir(config)
        try:
            report = build_report(sweep_dir)
            if out:
                # the same report again: its tables are already on the console
                build_report(sweep_dir, Path(OmegaConf.select(config, "hydra.runtime.cwd") or ".") / out,
                             console=Console(quiet=True))
        except (ReportError, OutputError) as e:
            log.error("sweep report: %s", e)
            sys.exit(1)
        log.info("sweep report: %s%s", sweep_dir / "table.md", f" and {out}" if out else "")
        self._log_wandb(config, report)
        if report.failed:
            log.error("%d job(s) failed: %s", len(report.failed), ", ".join(str(j.path) for j in report.failed))
            sys.exit(1)

    def _log_wandb(self, config: DictConfig, report: Report) -> None:
        from paged.experiment.wandb_logger import log_report

        swept = config_sweep(config)
        experiment = OmegaConf.select(config, "hydra.runtime.choices.experiment")
        log_report(config.logger, report.out_dir / "report", report.images, report.aggregated,
                   group=group_name(experiment, swept) or report.out_dir.name)


def _publish_dir(config: DictConfig) -> str | None:
    """`report.out` when `report.publish` is true: the committed results a sweep may replace only when
    asked to, so a trial run of a preset (fewer requests, another value) leaves them as they are."""
    out = OmegaConf.select(config, "report.out")
    if out and not OmegaConf.select(config, "report.publish", default=False):
        log.info("report.out=%s left as it is: its report is in the sweep folder (report.publish=true replaces it)",
                 out)
        return None
    return out


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60:d}:{minutes % 60:02d}:{s:02d}"
