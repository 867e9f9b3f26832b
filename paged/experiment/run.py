"""One experiment from a composed config: build, run the workload, write outputs, log to W&B."""

from __future__ import annotations

import gc
import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from paged.api.outputs import print_summary, write_outputs
from paged.cluster.fleet import Fleet
from paged.cluster.fleet_builder import build_fleet, uses_fleet
from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.metrics import RequestMetrics
from paged.engine.runner import drive, to_request
from paged.executor.base import Executor
from paged.experiment.summary import summarize
from paged.experiment.wandb_logger import WandbLogger
from paged.request import Request
from paged.utils.interrupt import Interrupt
from paged.workload import WorkloadItem, load_workload

log = logging.getLogger(__name__)


def run_experiment(
    cfg: Any,
    run_dir: Path,
    *,
    group: str | None = None,
    name: str | None = None,
    tags: list[str] | None = None,
    interrupt: Interrupt | None = None,
    progress_label: str = "requests",
) -> dict[str, Any]:
    """Build, run the workload, write summary.json and requests.jsonl into `run_dir`, log to W&B.
    With `cfg.progress`, a bar labelled `progress_label` shows the run (paged/engine/progress.py).

    With `interrupt`, SIGINT and SIGTERM request it while the workload runs and the outputs are
    written (not while the engine builds): the run stops between steps, aborts what is unfinished,
    and writes the partial results (`interrupted: true`); the caller reads `interrupt` to exit."""
    engine, load_time = _timed_build(cfg)
    executor = engine.executor
    requests = held_requests(workload_for(cfg, engine))
    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    wb = WandbLogger(
        cfg.logger, run_dir, config, group=group, name=name,
        job_type=f"{cfg.allocator.name}/{cfg.scheduler.name}/{cfg.kernel.name}",
        simulated=engine.clock.simulated, tags=tags,
    )
    if wb.run is not None:  # a listener makes every step build its record
        engine.metrics.step_listeners.append(wb.log_step)
    # the summary streams the step records (`StepStats`): a fleet hour's millions are not kept
    engine.metrics.keep_steps = False
    log.info("running %d request(s)%s", len(requests), "; Ctrl-C stops and writes what finished" if interrupt else "")
    try:
        with interrupt.catching() if interrupt is not None else nullcontext():
            requests, summary = _run(
                cfg, engine, requests, load_time, progress=cfg.progress, label=progress_label, stop=interrupt
            )
            # in item order; a stopped run's never-submitted requests are only counted (num_not_started)
            submitted = set(engine.metrics.requests)
            requests = [r for r in requests if r in submitted]
            decode = executor.tokenizer.decode if executor.tokenizer is not None else None
            write_outputs(run_dir, summary, requests, [RequestMetrics.of(r) for r in requests], decode)
            wb.finish(summary, engine.metrics.request_metrics(), run_dir)
    finally:
        if isinstance(engine, Engine):  # this run built it: stop its tensor-parallel workers now (a fleet's: _run)
            executor.shutdown()
    title = f"paged: {cfg.allocator.name} | {cfg.scheduler.name} | {executor.description}"
    print_summary(summary, title)
    log.info("wrote %s", run_dir)
    return summary


def run_quietly(overrides: list[str], *, executor: Executor | None = None) -> tuple[dict[str, Any], Engine | Fleet]:
    """The experiment scripts' run: compose `overrides` (no logger, no progress bar), build (on
    `executor` when given, so that repeated runs share its weights), run the workload, and return the
    summary (run.py's keys) and the engine; nothing is written."""
    cfg = compose_config(["logger=none", "progress=false", *overrides])
    engine, load_time = _timed_build(cfg, executor)
    _, summary = _run(cfg, engine, held_requests(workload_for(cfg, engine)), load_time, progress=False)
    return summary, engine


def workload_for(cfg: Any, engine: Engine | Fleet) -> list[WorkloadItem]:
    """`cfg.workload`'s requests in the executor's vocabulary, clipped to the scheduler's max length."""
    executor = engine.executor
    return load_workload(
        cfg.workload, executor.tokenizer, vocab_size=executor.vocab_size, max_model_len=cfg.scheduler.max_model_len
    )


def held_requests(items: list[WorkloadItem]) -> list[Request]:
    """The workload's requests, each held compactly until `drive` submits it (`Request.compact`),
    made as `items` is emptied: a fleet hour's prompts (100M tokens) are never held twice."""
    items.reverse()
    requests = []
    while items:
        request = to_request(items.pop())
        request.compact()
        requests.append(request)
    return requests


def _timed_build(cfg: Any, executor: Executor | None = None) -> tuple[Engine | Fleet, float]:
    """One engine, or a fleet of them when `cfg.cluster` asks for more (`executor` is then unused)."""
    start = time.perf_counter()
    engine = build_fleet(cfg) if uses_fleet(cfg) else build_engine(cfg, executor=executor)
    return engine, time.perf_counter() - start


def _run(
    cfg: Any,
    engine: Engine | Fleet,
    requests: list[Request],
    load_time: float,
    *,
    progress: bool,
    label: str = "requests",
    stop: Interrupt | None = None,
) -> tuple[list[Request], dict[str, Any]]:
    """Run `requests` (`held_requests`); they (in item order) and the run's summary. A fleet is shut
    down once its requests ran (or failed): its actors free their machines, its stats stay readable."""
    start = time.perf_counter()
    engine.clock.reset()  # the items' arrival times are seconds from the start
    # The engine and the requests live for the whole run: frozen, the collector stops re-scanning
    # them (at paper or fleet scale millions of objects, 5-15% of a simulated run's host time).
    gc.freeze()
    try:
        # the run reads finished requests only for requests.jsonl and the metrics: compact tokens
        stopped = drive(engine, requests, progress=progress, label=label, stop=stop, compact=True)
    finally:
        gc.unfreeze()
        if isinstance(engine, Fleet):
            engine.shutdown()
    host_time = time.perf_counter() - start
    return requests, summarize(
        cfg, engine, host_time_s=host_time, load_time_s=load_time,
        num_not_started=len(requests) - len(engine.metrics.requests), interrupted=stopped,
    )
