"""What a sweep varies: its swept keys and their values, read from Hydra's overrides.

A job knows only its own values; the sweep's raw overrides (`allocator=naive,prefix`) and a
preset's `hydra.sweeper.params` are in the sweep folder's `multirun.yaml`, which Hydra writes
before it launches any job, so a job can tag itself with the keys its sweep varies."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

# the sweep index a researcher adds to repeat a configuration; aggregated, never a line or a column
REPEAT_KEY = "repeat"


def override_key(text: str) -> str:
    """`+workload.n=2` -> `workload.n`: the key an override sets, without Hydra's prefixes."""
    return text.split("=", 1)[0].lstrip("+~")


def parse_overrides(texts: Iterable[str]) -> dict[str, str]:
    """One job's overrides (`.hydra/overrides.yaml`) as key -> value text."""
    return {override_key(t): t.split("=", 1)[1] for t in texts if "=" in t}


def sweep_choices(params: Mapping[str, Any], task: Iterable[str]) -> dict[str, list[str] | None]:
    """Swept key -> its values (None: a glob, whose values Hydra expands against the config).
    As Hydra's basic sweeper: `hydra.sweeper.params` first, a command-line override of the same key wins."""
    texts = {override_key(f"{k}={v}"): f"{k}={v}" for k, v in params.items()}
    texts |= {override_key(t): t for t in task}
    swept: dict[str, list[str] | None] = {}
    for override in OverridesParser.create().parse_overrides(list(texts.values())):
        if not override.is_sweep_override():
            continue
        key = override.get_key_element().lstrip("+~")
        glob = override.value_type is not None and override.value_type.name == "GLOB_CHOICE_SWEEP"
        swept[key] = None if glob else list(override.sweep_string_iterator())
    return swept


def run_command(root: Path) -> str | None:
    """The `run.py` command line, with every override it was given (Hydra's own `hydra.*` aside), that
    ran the sweep (its `multirun.yaml`) or the single run (its `.hydra/overrides.yaml`) in `root`."""
    if (root / "multirun.yaml").is_file():
        task = OmegaConf.select(OmegaConf.load(root / "multirun.yaml"), "hydra.overrides.task")
        return shlex.join(["python", "run.py", "-m", *task]) if task is not None else None
    if (root / ".hydra" / "overrides.yaml").is_file():
        return shlex.join(["python", "run.py", *OmegaConf.load(root / ".hydra" / "overrides.yaml")])
    return None


def read_sweep(sweep_dir: Path) -> dict[str, list[str] | None]:
    """The swept keys of the sweep in `sweep_dir` (empty if it has no readable multirun.yaml)."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return {}
    return config_sweep(OmegaConf.load(path))


def config_sweep(cfg: Any) -> dict[str, list[str] | None]:
    """The swept keys of a multirun's config (its `hydra.sweeper.params` and `hydra.overrides.task`)."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params")
    task = OmegaConf.select(cfg, "hydra.overrides.task")
    return sweep_choices(
        OmegaConf.to_container(params) if params is not None else {}, list(task) if task is not None else []
    )


def num_jobs(swept: Mapping[str, list[str] | None]) -> int | None:
    """Jobs in a grid sweep over `swept`; None when a glob leaves it unknown."""
    if any(values is None for values in swept.values()):
        return None
    return math.prod(len(values) for values in swept.values() if values is not None)


def tags(swept: Iterable[str], overrides: Mapping[str, str]) -> list[str]:
    """A job's `key=value` tags for the keys its sweep varies."""
    return [f"{key}={overrides[key]}" for key in swept if key in overrides]


def group_name(experiment: str | None, swept: Iterable[str]) -> str | None:
    """The W&B group of a sweep's runs: its experiment preset, else the keys it sweeps, so two sweeps
    of the same comparison land together (a clock time would keep them apart)."""
    if experiment:
        return experiment
    keys = [k for k in swept if k != REPEAT_KEY]
    return "sweep:" + ",".join(keys) if keys else None
