"""Collect the jobs of a run or sweep folder: each job's overrides, summary, or why it failed."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from paged.report.sweep import REPEAT_KEY, parse_overrides

# keys only a simulated run's summary has; a sweep over `executor=model,sim` mixes both kinds
SIM_ONLY_KEYS = frozenset({"sim_time_s", "sim_seconds_per_host_second", "hardware", "num_gpus"})
# written only by a run with a KV press (`paged.scheduler.press_step`): a sweep over kv_press=none and a press
# compares runs with and without them
KV_PRESS_KEYS = frozenset({"kv_press", "kv_press_num_compressions", "kv_press_tokens_kept", "kv_press_tokens_evicted",
                           "kv_press_blocks_freed", "kv_press_compaction_s"})


class ReportError(ValueError):
    """A folder the report cannot read as one sweep; the message names the files and why."""


def reject_unknown(node: Any, allowed: set[str], where: str) -> None:
    """A `report` setting with a key nobody reads is a typo: name it and the keys there are."""
    if unknown := set(node) - allowed:
        raise ReportError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


@dataclass
class Job:
    path: Path  # the job folder, relative to the collected root
    overrides: dict[str, str]
    summary: dict[str, Any] | None = None
    error: str | None = None  # why it has no summary (`error.json`), if it says
    experiment: str | None = None  # the `+experiment=` preset it ran
    report: dict[str, Any] = field(default_factory=dict)  # the preset's `report` node


@dataclass
class Collection:
    root: Path
    jobs: list[Job]  # the jobs with a summary
    failed: list[Job]
    swept: list[str]  # keys whose values differ between jobs (columns), in first-seen order

    @property
    def experiment(self) -> str | None:
        names = {j.experiment for j in self.jobs}
        return names.pop() if len(names) == 1 else None

    @property
    def report(self) -> dict[str, Any]:
        return self.jobs[0].report if self.jobs else {}


def _job_dirs(root: Path) -> list[Path]:
    """Folders holding a job: a Hydra `.hydra/` or a `summary.json` (W&B's own folders excluded)."""
    found = {p.parent for p in root.rglob("summary.json")}
    found |= {p.parent.parent for p in root.rglob(".hydra/config.yaml")}
    return sorted((d for d in found if "wandb" not in d.relative_to(root).parts), key=_job_order)


def _job_order(path: Path) -> tuple:
    # Hydra names sweep jobs `<num>_<overrides>`: order by the number, not as text (10 after 9)
    head = path.name.split("_", 1)[0]
    return (str(path.parent), int(head) if head.isdigit() else -1, path.name)


def _read_job(root: Path, job_dir: Path) -> Job:
    hydra_dir = job_dir / ".hydra"
    overrides: dict[str, str] = {}
    experiment, report = None, {}
    if (hydra_dir / "overrides.yaml").is_file():
        overrides = parse_overrides(OmegaConf.load(hydra_dir / "overrides.yaml"))
    if (hydra_dir / "hydra.yaml").is_file():
        experiment = OmegaConf.select(OmegaConf.load(hydra_dir / "hydra.yaml"), "hydra.runtime.choices.experiment")
    if (hydra_dir / "config.yaml").is_file():
        node = OmegaConf.select(OmegaConf.load(hydra_dir / "config.yaml"), "report")
        report = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    job = Job(job_dir.relative_to(root), overrides, experiment=experiment, report=report or {})
    summary_path = job_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            raise ReportError(f"{summary_path}: not valid JSON ({e})") from e
        if not isinstance(summary, dict):
            raise ReportError(f"{summary_path}: a summary is a JSON object of metrics, got {type(summary).__name__}")
        job.summary = summary
    elif (job_dir / "error.json").is_file():
        try:
            error = json.loads((job_dir / "error.json").read_text())
            job.error = f"{error.get('type', 'error')}: {error.get('message', '')}"
        except (json.JSONDecodeError, AttributeError):
            job.error = "error.json is unreadable (the job failed; its run.log says why)"
    else:
        job.error = "no summary.json (the job is still running, or was killed)"
    return job


def _check_schemas(root: Path, jobs: list[Job]) -> None:
    """Every summary must carry the same metrics (the simulator's and a KV press's own keys aside); one written by
    another version of paged, or a stray JSON file, would silently leave holes in the table."""
    by_keys: dict[frozenset[str], list[Job]] = defaultdict(list)
    for job in jobs:
        assert job.summary is not None
        by_keys[frozenset(job.summary) - SIM_ONLY_KEYS - KV_PRESS_KEYS].append(job)
    if len(by_keys) < 2:
        return
    groups = sorted(by_keys.items(), key=lambda kv: -len(kv[1]))
    common = frozenset.intersection(*by_keys)
    lines = [f"summaries under {root} have {len(groups)} different schemas (sets of keys):"]
    for keys, members in groups:
        extra = sorted(keys - common)
        files = ", ".join(str(j.path / "summary.json") for j in members[:4]) + (" ..." if len(members) > 4 else "")
        shown = f" incl. {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}" if extra else ""
        lines.append(f"  {len(members)} file(s) with {len(keys)} keys{shown}: {files}")
    lines.append("report one schema at a time (e.g. re-run the older jobs with this version of paged)")
    raise ReportError("\n".join(lines))


def collect(root: Path) -> Collection:
    """Read every job under `root`; raises ReportError when none has a summary or schemas differ."""
    if not root.is_dir():
        raise ReportError(f"{root}: not a folder (give a run or sweep folder, e.g. multirun/2026-11-23/10-00-00)")
    jobs = [_read_job(root, d) for d in _job_dirs(root)]
    done = [j for j in jobs if j.summary is not None]
    failed = [j for j in jobs if j.summary is None]
    if not done:
        detail = "".join(f"\n  {j.path}: {j.error}" for j in failed) or " (no job folders: no .hydra/ or summary.json)"
        raise ReportError(f"no summary.json under {root}{detail}")
    _check_schemas(root, done)
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job.overrides if k not in keys]
    swept = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1 or k == REPEAT_KEY]
    if len(jobs) == 1:
        swept = keys  # one run: its overrides are what sets it apart
    return Collection(root, done, failed, swept)
