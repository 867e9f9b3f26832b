"""One experiment: `python run.py [group=option ...] [key=value ...]`, or a sweep with `-m`.

Writes summary.json, requests.jsonl, the Hydra config and an offline W&B run into the Hydra run
directory (`hydra.run.dir=...` moves it). In a sweep, a job that fails writes error.json instead
and the sweep goes on; the report at its end (paged/report/callback.py) lists it.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from paged.config import ConfigError, register_configs
from paged.experiment import run_experiment
from paged.report.sweep import group_name, parse_overrides, read_sweep, tags

register_configs()
log = logging.getLogger("paged")


def _run(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    experiment = hc.runtime.choices.get("experiment")
    swept = read_sweep(Path(hc.sweep.dir)) if hc.mode.name == "MULTIRUN" else {}
    summary = run_experiment(
        cfg,
        Path(hc.runtime.output_dir),
        group=group_name(experiment, swept),
        name=hc.job.override_dirname or None,
        tags=tags(swept, parse_overrides(hc.overrides.task)),
    )
    return float(summary["output_tokens_per_s"])


def _record_failure(error: BaseException) -> float:
    """A sweep's failed job: error.json names it for the report; the other jobs still run."""
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    (out / "error.json").write_text(json.dumps(record, indent=2) + "\n")
    log.error("job failed (%s): %s: %s", out.name, type(error).__name__, error)
    return float("nan")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        return _run(cfg)
    except Exception as e:
        if HydraConfig.get().mode.name == "MULTIRUN":
            return _record_failure(e)
        if not isinstance(e, ConfigError | FileNotFoundError):
            raise
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
