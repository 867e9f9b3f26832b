"""One experiment from a composed config: build, run the workload, write outputs, log to W&B."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from paged.build import build_engine
from paged.outputs import print_summary, write_outputs
from paged.runner import run_workload
from paged.wandb_logger import WandbLogger
from paged.workload import load_workload

log = logging.getLogger(__name__)


def run_experiment(cfg: Any, run_dir: Path, *, group: str | None = None, name: str | None = None) -> dict[str, Any]:
    engine = build_engine(cfg)
    executor = engine.executor
    log.info("attention: %s", executor.kernel_description)
    items = load_workload(cfg.workload, executor.tokenizer)
    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    wb = WandbLogger(
        cfg.logger, run_dir, config, group=group, name=name,
        job_type=f"{cfg.allocator.name}/{cfg.scheduler.name}/{cfg.kernel.name}",
    )
    engine.metrics.step_listeners.append(wb.log_step)
    requests = run_workload(engine, items, progress=cfg.progress)
    bm = engine.block_manager
    summary = engine.metrics.summary(
        num_total_blocks=bm.num_total_blocks,
        kv_blocks_in_use_end=bm.stats().num_allocated_blocks,
        caches_prefixes=bm.allocator.caches_prefixes,
    )
    summary["attention_kernel"] = executor.kernel_description
    write_outputs(run_dir, summary, requests, engine.metrics.request_metrics(), executor.tokenizer.decode)
    wb.finish(summary)
    title = f"paged: {cfg.model.name} | {cfg.allocator.name} | {cfg.scheduler.name} | {executor.kernel_description}"
    print_summary(summary, title)
    log.info("wrote %s", run_dir)
    return summary
