"""One experiment: `python run.py [group=option ...] [key=value ...]`, or a sweep with `-m`.

Writes summary.json, requests.jsonl, the Hydra config and an offline W&B run into the Hydra run
directory (`hydra.run.dir=...` moves it).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from paged.config import ConfigError, register_configs
from paged.experiment import run_experiment

register_configs()
log = logging.getLogger("paged")


def _run(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    summary = run_experiment(
        cfg,
        Path(hc.runtime.output_dir),
        group=os.path.basename(hc.sweep.dir) if multirun else None,
        name=hc.job.override_dirname or None,
    )
    return float(summary["output_tokens_per_s"])


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        return _run(cfg)
    except (ConfigError, FileNotFoundError) as e:
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
