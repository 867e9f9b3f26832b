"""One experiment: `python run.py [group=option ...] [key=value ...]`, or a sweep with `-m`.

Writes summary.json, requests.jsonl, the Hydra config and an offline W&B run into the Hydra run
directory (`hydra.run.dir=...` moves it). In a sweep, a job that fails writes error.json instead
and the sweep goes on; the report at its end (paged/report/callback.py) lists it. Ctrl-C or SIGTERM
while the requests run stops the run (and a sweep), writes its partial results (`interrupted: true`)
and exits 130 / 143 (docs/running.md, "Interrupting a run").
"""

from __future__ import annotations

import io
import json
import logging
import sys
import tempfile
import traceback
from contextlib import redirect_stderr
from pathlib import Path

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from paged.config import ConfigError, check_command_line, register_configs
from paged.report.sweep import group_name, num_jobs, parse_overrides, read_sweep, tags
from paged.utils.atomic_file import OutputError, write_text
from paged.utils.interrupt import Interrupt

register_configs()
log = logging.getLogger("paged")


def _run(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    experiment = hc.runtime.choices.get("experiment")
    multirun = hc.mode.name == "MULTIRUN"
    if experiment and not multirun and hc.sweeper.get("params"):
        # run without -m, a sweep preset would run one job of the defaults, not the sweep it names
        raise ConfigError(
            f"experiment={experiment} is a sweep preset: run it with -m (python run.py -m +experiment={experiment})"
        )
    swept = read_sweep(Path(hc.sweep.dir)) if multirun else {}
    # imported here: it loads torch, which --help and a bad command line need not wait for
    from paged.experiment.run import run_experiment

    interrupt = Interrupt()
    summary = run_experiment(
        cfg,
        Path(hc.runtime.output_dir),
        group=group_name(experiment, swept),
        name=hc.job.override_dirname or None,
        tags=tags(swept, parse_overrides(hc.overrides.task)),
        interrupt=interrupt,
        # a sweep's job says which it is while it runs: the sweep's own count moves only between jobs
        progress_label=f"job {hc.job.num + 1}/{num_jobs(swept) or '?'}" if multirun else "requests",
    )
    if interrupt.requested:
        sweep_dir = Path(hc.sweep.dir) if multirun else None
        _exit_interrupted(interrupt, Path(hc.runtime.output_dir), sweep_dir, partial=summary["interrupted"])
    return float(summary["output_tokens_per_s"])


def _exit_interrupted(interrupt: Interrupt, out: Path, sweep_dir: Path | None, *, partial: bool) -> None:
    """The run stopped on a signal and wrote what it had (all of it, when the signal came only while
    the outputs were written): say where, and end with the signal's exit code (130 SIGINT, 143
    SIGTERM), which also ends a sweep before its next job."""
    where = f"{'partial results' if partial else 'results (complete)'} in {out}"
    if sweep_dir is not None:
        where += f"; the sweep stops here (python -m paged.report {sweep_dir} reports the jobs so far)"
    log.warning("interrupted by %s: %s", interrupt.signal_name, where)
    print(f"interrupted by {interrupt.signal_name}: {where}", file=sys.stderr)
    sys.exit(interrupt.exit_code)


def _record_failure(error: BaseException) -> float:
    """A sweep's failed job: error.json names it for the report; the other jobs still run."""
    out = Path(HydraConfig.get().runtime.output_dir)
    record = {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    log.error("job failed (%s): %s: %s", out.name, type(error).__name__, error)
    try:
        write_text(out / "error.json", json.dumps(record, indent=2) + "\n")
    except OutputError as e:
        log.error("%s (the report will list this job as killed)", e)
    return float("nan")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        return _run(cfg)
    except Exception as e:
        if HydraConfig.get().mode.name == "MULTIRUN":
            return _record_failure(e)
        if not isinstance(e, ConfigError | FileNotFoundError | OutputError):
            raise
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# Hydra's flags that show something instead of running a job (no run folder is made)
_NO_JOB_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")


def _run_dir_problem(argv: list[str]) -> str | None:
    """Why the run (or sweep) folder cannot be made, or None. Hydra makes it before any of our code
    runs and reports a failure as a traceback, so this looks first: the nearest existing folder of
    `hydra.run.dir` (`hydra.sweep.dir` with -m), as given or as conf/config.yaml sets it, must take
    new files. Hydra's own parser reads `argv`, so that --help, --cfg and -m keep their meaning."""
    try:
        with redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None  # a usage error, which Hydra reports itself
    if any(getattr(args, flag, None) for flag in _NO_JOB_FLAGS):
        return None
    key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in args.overrides if "=" in o and o.split("=", 1)[0].lstrip("+") == key]
    if given:
        setting = f"{key}={given[-1]}"
        value = given[-1].strip("'\"")
    else:
        hydra_node = OmegaConf.to_container(OmegaConf.load(Path(__file__).parent / "conf" / "config.yaml").hydra)
        value = hydra_node[key.split(".")[1]]["dir"]  # as written: its ${now:...} resolves in Hydra only
        setting = f"the default run folder {value} (set {key}=... to move it)"
    # the part before any interpolation (${now:...}), then up to the first folder that exists
    parts = Path(value).parts
    folder = Path(*parts[:next((i for i, p in enumerate(parts) if "${" in p), len(parts))] or ["."])
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"{setting}: cannot create the run folder, {folder} takes no new files ({e.strerror or e})"
    return None


if __name__ == "__main__":
    try:  # Hydra's own error for an unknown key would suggest adding it with `+`
        check_command_line(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if (problem := _run_dir_problem(sys.argv[1:])) is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
