"""Weights & Biases sink: one run per job, per-step metrics against `engine_step` (against
`sim_time_s` when the run is simulated), final summary, per-request table and latency histograms,
and the run's output files as an artifact; `log_report` adds one run for a sweep's plots and table.

Offline by default (files under the run dir, `wandb sync` later). A W&B failure is a warning,
never a failed run. `WANDB_MODE=disabled` in the environment wins over the config so a test suite
can never reach the network.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from paged.config import LoggerConfig
from paged.engine.metrics import RequestMetrics, StepRecord

log = logging.getLogger(__name__)

_TAG_MAX_CHARS = 64  # W&B rejects a longer tag, and with it the whole run
_ARTIFACT_NAME_MAX_CHARS = 128
_OUTPUT_FILES = ("summary.json", "requests.jsonl")
_HISTOGRAMS = {
    "ttft_s": "TTFT (s)",
    "tpot_s": "TPOT (s)",
    "e2e_latency_s": "e2e latency (s)",
    "normalized_latency_s_per_token": "normalized latency (s/token)",
}


class WandbLogger:
    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        config: dict[str, Any],
        *,
        group: str | None = None,
        name: str | None = None,
        job_type: str | None = None,
        simulated: bool = False,
        tags: list[str] | None = None,
    ) -> None:
        self.simulated = simulated
        # W&B draws a chart from ~1500 points; a simulated hour has 100k+ steps, and one log call
        # per step would take longer than the simulation itself
        self.step_interval = max(1, int(_setting(cfg, "step_interval", 1)))
        self.name = name
        self.run: Any = _start_run(
            cfg, run_dir, config=config, group=group, name=name, job_type=job_type, tags=tags or []
        )
        # a failed step log leaves the run open for the summary, tables and artifact at `finish`
        self.steps_failed = self.run is not None and not _attempt(
            "W&B step metric definition failed, steps are not logged", self._define_step_metric
        )

    def _define_step_metric(self) -> None:
        step_metric = "sim_time_s" if self.simulated else "engine_step"
        self.run.define_metric(step_metric)
        self.run.define_metric("step/*", step_metric=step_metric)

    def log_step(self, record: StepRecord) -> None:
        if self.run is None or self.steps_failed or record.engine_step % self.step_interval:
            return
        # W&B charts numbers; the step's kernel version is counted in the summary instead
        data = {
            f"step/{k}": v for k, v in record.as_dict().items() if k != "engine_step" and isinstance(v, int | float)
        }
        data["engine_step"] = record.engine_step
        if self.simulated:
            data["sim_time_s"] = record.time_s
        self.steps_failed = not _attempt("W&B step logging failed, no more steps are logged", self.run.log, data)

    def finish(
        self,
        summary: dict[str, Any],
        request_metrics: list[RequestMetrics] | None = None,
        run_dir: Path | None = None,
    ) -> None:
        """Summary, then the per-request table and histograms, then `run_dir`'s outputs as an artifact."""
        run, self.run = self.run, None
        if run is None:
            return
        # each part on its own, so one failure loses only that part
        _attempt("W&B summary failed", run.summary.update, {k: v for k, v in summary.items() if v is not None})
        if request_metrics:
            _attempt("W&B request table failed", lambda: run.log(_request_charts(request_metrics)))
        if run_dir is not None:
            _attempt("W&B outputs artifact failed", _log_outputs, run, self.name or run.id, run_dir)
        # finished even after a failure, so the offline run is closed and can be synced
        _attempt("W&B finish failed", run.finish)


def log_report(
    cfg: Any,
    out_dir: Path,
    images: list[Path],
    rows: list[dict[str, Any]],
    *,
    group: str,
    name: str = "report",
    config: dict[str, Any] | None = None,
) -> None:
    """One W&B run (job type `report`) holding a sweep's plots, each under its file stem, and its
    results table under `results`. Same mode rules as `WandbLogger`; failures only warn."""
    run = _start_run(cfg, out_dir, config=config or {}, group=group, name=name, job_type="report", tags=[])
    if run is None:
        return
    _attempt("W&B report logging failed", lambda: run.log(_report_data(images, rows)))
    _attempt("W&B finish failed", run.finish)


def _start_run(
    cfg: Any,
    run_dir: Path,
    *,
    config: dict[str, Any],
    group: str | None,
    name: str | None,
    job_type: str | None,
    tags: list[str],
) -> Any:
    """A started W&B run, or None where W&B is off or fails to start."""
    if os.environ.get("WANDB_MODE") == "disabled":
        return None
    try:
        mode = _setting(cfg, "mode")
        if _setting(cfg, "backend") != "wandb" or mode == "disabled":
            return None
        import wandb  # ~0.7 s to import: only runs that log pay it

        run_dir.mkdir(parents=True, exist_ok=True)  # W&B falls back to a temp dir when `dir` is missing
        return wandb.init(
            project=_setting(cfg, "project"),
            entity=_setting(cfg, "entity"),
            mode=mode,
            dir=str(run_dir),
            config=config,
            group=group,
            name=name,
            job_type=job_type,
            tags=_clip_tags([*_setting(cfg, "tags"), *tags]),
            reinit="finish_previous",
            settings=wandb.Settings(init_timeout=30, silent=True),
        )
    except Exception as e:  # noqa: BLE001
        _warn("W&B disabled for this run", e)
        return None


def _setting(cfg: Any, key: str, default: Any = None) -> Any:
    # a LoggerConfig dataclass has attributes; a Hydra DictConfig or plain dict has items
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def _clip_tags(tags: Iterable[str]) -> list[str]:
    """Tags W&B accepts: non-empty, at most 64 characters (longer ones keep their start, which holds
    a swept key, and their end, where swept values tend to differ), without repeats."""
    head = (_TAG_MAX_CHARS - 3) // 2 + 1
    tail = _TAG_MAX_CHARS - 3 - head
    clipped = (t if len(t) <= _TAG_MAX_CHARS else f"{t[:head]}...{t[-tail:]}" for t in map(str, tags) if t)
    return list(dict.fromkeys(clipped))


def _artifact_name(name: str) -> str:
    """`name` with every run of characters W&B forbids in artifact names made one underscore."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:_ARTIFACT_NAME_MAX_CHARS]


def _request_charts(metrics: list[RequestMetrics]) -> dict[str, Any]:
    import wandb

    # columns from the dataclass, so a field added to RequestMetrics shows up without a change here
    columns = [f.name for f in dataclasses.fields(metrics[0])]
    rows = [[getattr(m, c) for c in columns] for m in metrics]
    charts: dict[str, Any] = {"requests": wandb.Table(columns=columns, data=rows, allow_mixed_types=True)}
    for column, title in _HISTOGRAMS.items():
        # aborted or one-token requests have no value; binning a null would draw a spurious bar
        i = columns.index(column)
        values = wandb.Table(columns=[column], data=[[row[i]] for row in rows if row[i] is not None])
        charts[f"hist/{column}"] = wandb.plot.histogram(values, column, title=title)
    return charts


def _log_outputs(run: Any, name: str, run_dir: Path) -> None:
    import wandb

    files = [run_dir / f for f in _OUTPUT_FILES if (run_dir / f).is_file()]
    if not files:
        return
    artifact = wandb.Artifact(_artifact_name(name), type="run-outputs")
    for path in files:
        artifact.add_file(str(path), name=path.name)
    run.log_artifact(artifact)


def _report_data(images: list[Path], rows: list[dict[str, Any]]) -> dict[str, Any]:
    import wandb

    data: dict[str, Any] = {path.stem: wandb.Image(str(path)) for path in images}
    if rows:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data["results"] = wandb.Table(
            columns=columns, data=[[row.get(c) for c in columns] for row in rows], allow_mixed_types=True
        )
    return data


def _attempt(what: str, fn: Callable[..., Any], *args: Any) -> bool:
    """Calls `fn`; a failure is a warning, and False."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - any W&B failure must not fail the experiment
        _warn(what, e)
        return False
    return True


def _warn(what: str, e: Exception) -> None:
    log.warning("%s: %s: %s", what, type(e).__name__, e)
