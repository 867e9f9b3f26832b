"""Experiment presets: every value they sweep passes check_config (keys, lengths, files), a preset
runs only as its sweep (`-m`), and its sweep replaces the committed `experiments/results/NAME/` only
with `report.publish=true`, recording in table.md the command that ran it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from paged.config import compose_config
from paged.engine.builder import check_config
from paged.report.callback import _publish_dir
from paged.report.sweep import run_command

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
# swept keys whose values no check depends on: their first value stands for all
UNCHECKED = {"workload.arrival_rate", "repeat"}


@pytest.mark.parametrize("name", PRESETS)
def test_every_swept_value_of_a_preset_passes_check_config(name: str) -> None:
    params = OmegaConf.load(REPO / "conf" / "experiment" / f"{name}.yaml").hydra.sweeper.params
    assert params, f"{name} is not a sweep: run.py would refuse it with and without -m"
    values = {key: str(value).split(",") for key, value in params.items()}
    first = {key: vs[0] for key, vs in values.items()}
    jobs = [first, *({**first, key: v} for key, vs in values.items() if key not in UNCHECKED for v in vs[1:])]
    for job in jobs:
        check_config(compose_config([f"+experiment={name}", *(f"{k}={v}" for k, v in job.items())]))


def _config(out: str | None, publish: bool | None) -> OmegaConf:
    report = {"out": out} | ({"publish": publish} if publish is not None else {})
    return OmegaConf.create({"report": report})


@pytest.mark.parametrize(
    ("out", "publish", "expected"),
    [
        ("experiments/results/fig2", False, None),
        ("experiments/results/fig2", None, None),
        ("experiments/results/fig2", True, "experiments/results/fig2"),
        (None, True, None),
    ],
)
def test_a_preset_publishes_to_report_out_only_when_asked(out, publish, expected) -> None:
    assert _publish_dir(_config(out, publish)) == expected


def test_run_command_records_every_override_of_a_sweep_and_of_a_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    task = ["+experiment=fig2", "workload.num_requests=20", "workload.path=a b.jsonl"]
    OmegaConf.save({"hydra": {"overrides": {"task": task, "hydra": ["hydra.sweep.dir=x"]}}}, sweep / "multirun.yaml")
    assert run_command(sweep) == "python run.py -m +experiment=fig2 workload.num_requests=20 'workload.path=a b.jsonl'"
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["model=tiny-random"]), run / ".hydra" / "overrides.yaml")
    assert run_command(run) == "python run.py model=tiny-random"
    assert run_command(tmp_path) is None


def test_a_preset_sweep_leaves_the_committed_results_and_records_its_overrides(tmp_path: Path) -> None:
    """From another folder, so `report.out` (relative to the launch folder) would land under it."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "run.py"), "-m", "+experiment=table1", "setup=opt-13b",
           "workload.num_requests=2", "hydra/launcher=basic", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, WANDB_MODE="disabled"), capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "experiments").exists()
    table = (sweep / "table.md").read_text()
    assert "Run by `python run.py -m +experiment=table1 setup=opt-13b workload.num_requests=2`" in table
    assert "report.publish=true replaces it" in proc.stderr + proc.stdout


def test_every_preset_still_writes_its_report_out_when_published() -> None:
    for name in PRESETS:
        cfg = compose_config([f"+experiment={name}", "report.publish=true"])
        assert _publish_dir(cfg) == f"experiments/results/{name}"
