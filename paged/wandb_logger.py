"""Weights & Biases sink: one run per job, per-step metrics against `engine_step` (against
`sim_time_s` when the run is simulated), final summary.

Offline by default (files under the run dir, `wandb sync` later). A W&B failure is a warning,
never a failed run. `WANDB_MODE=disabled` in the environment wins over the config so a test suite
can never reach the network.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from paged.config import LoggerConfig
from paged.metrics import StepRecord

log = logging.getLogger(__name__)


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
    ) -> None:
        self.run: Any = None
        self.simulated = simulated
        mode = "disabled" if os.environ.get("WANDB_MODE") == "disabled" else cfg.mode
        if cfg.backend != "wandb" or mode == "disabled":
            return
        try:
            import wandb  # ~0.7 s to import: only runs that log pay it


            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                mode=mode,
                dir=str(run_dir),
                config=config,
                group=group,
                name=name,
                job_type=job_type,
                tags=list(cfg.tags),
                reinit="finish_previous",
                settings=wandb.Settings(init_timeout=30, silent=True),
            )
            step_metric = "sim_time_s" if simulated else "engine_step"
            self.run.define_metric(step_metric)
            self.run.define_metric("step/*", step_metric=step_metric)
        except Exception as e:  # noqa: BLE001 - any W&B failure must not fail the experiment
            log.warning("W&B disabled for this run: %s: %s", type(e).__name__, e)
            self.run = None

    def log_step(self, record: StepRecord) -> None:
        if self.run is None:
            return
        # W&B charts numbers; the step's kernel version is counted in the summary instead
        data = {
            f"step/{k}": v for k, v in record.as_dict().items() if k != "engine_step" and isinstance(v, int | float)
        }
        data["engine_step"] = record.engine_step
        if self.simulated:
            data["sim_time_s"] = record.time_s
        self._call(self.run.log, data)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        self._call(self.run.summary.update, {k: v for k, v in summary.items() if v is not None})
        self._call(self.run.finish)
        self.run = None

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            log.warning("W&B call failed, disabling W&B for this run: %s", e)
            self.run = None
