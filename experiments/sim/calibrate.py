"""(Re-)measure `hardware=cpu-local` on this machine for one config, print the values, cache them.

    python experiments/sim/calibrate.py [override ...]      # Hydra overrides, as for run.py

e.g. `python experiments/sim/calibrate.py model=smollm2-135m model.gemm=torch`. `executor=sim
hardware=cpu-local` measures on first use and reads the cache afterwards; this re-measures
(`paged/sim/calibrate.py` says what is measured and what keys the cache).
"""

from __future__ import annotations

import logging
import sys

import torch
from hydra.errors import HydraException
from rich.console import Console
from rich.table import Table

from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine, check_config
from paged.sim.calibrate import cache_path, dtype_name, measure


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = compose_config(["executor=sim", "hardware=cpu-local", "logger=none", "progress=false", *argv])
    check_config(cfg)  # every key and plugin setting, as run.py checks them, before anything is measured
    path = cache_path(cfg)
    values = measure(cfg, build_engine, path)
    table = Table(title=f"cpu-local for {cfg.model.name} ({dtype_name(cfg)}), {torch.get_num_threads()} threads")
    table.add_column("value")
    table.add_column("measured", justify="right")
    for key, value in values.items():
        shown = ", ".join(f"{t:g}:{e:.2f}" for t, e in value) if key == "matmul_efficiency" else f"{value:.4g}"
        table.add_row(key, shown)
    Console().print(table)
    print(f"cached in {path}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, HydraException, FileNotFoundError) as err:
        # a bad override or an unmeasurable config: one line naming it, no traceback
        sys.exit(f"calibrate: {err}")
