"""The step statistics' value columns spilled to a file every `SPILL_STEPS` steps (bounded memory for
a fleet hour): summary.json and requests.jsonl byte-identical to the columns held whole, for one
engine and a fleet, with every column spilled several times."""

from __future__ import annotations

import pytest

import paged.engine.step_stats as step_stats
from paged.config import compose_config
from paged.experiment.run import run_experiment

BASE = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "kernel=vllm", "workload=sharegpt",
        "workload.num_requests=24", "workload.arrival_rate=8", "workload.output_len_max=160",
        "scheduler.max_model_len=2048", "logger=none", "progress=false", "allocator=prefix",
        "workload.shared_prefix_len=64", "workload.num_prefixes=3"]
# the summary keys that time the host: the only ones two runs of one config may differ in
HOST_KEYS = ('"host_time_s"', '"load_time_s"', '"sim_seconds_per_host_second"')


def _outputs(overrides: list[str], path) -> tuple[str, str, int]:
    run_experiment(compose_config(overrides), path)
    summary = (path / "summary.json").read_text()
    steps = int(next(line for line in summary.splitlines() if '"num_engine_steps"' in line).split(":")[1].strip(" ,"))
    kept = "".join(line for line in summary.splitlines(keepends=True) if not line.strip().startswith(HOST_KEYS))
    return kept, (path / "requests.jsonl").read_text(), steps


@pytest.mark.parametrize("extra", [[], ["cluster.num_replicas=3", "router=prefix-aware"]], ids=["engine", "fleet"])
def test_spilled_columns_give_the_same_summary(tmp_path, monkeypatch, extra):
    whole = _outputs([*BASE, *extra], tmp_path / "whole")
    monkeypatch.setattr(step_stats, "SPILL_STEPS", 7)
    spilled = _outputs([*BASE, *extra], tmp_path / "spilled")
    assert spilled[2] > 5 * 7  # every column went to the file several times
    assert spilled == whole
