"""Smoke test of experiments/paper/sharing.py (the memory-sharing study) on the simulator, at a few requests."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "experiments" / "paper" / "sharing.py"


@pytest.fixture(scope="module")
def sharing():
    spec = importlib.util.spec_from_file_location("experiment_sharing", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_reference_and_difference(sharing) -> None:
    assert sharing.paper_value("alpaca", "beam", 4) == ("53.13", 53.13, None)
    assert sharing.paper_value("sharegpt", "parallel", 2)[1] == 16.2
    label, point, span = sharing.paper_value("sharegpt", "beam", 4)
    assert point is None and span == (44.3, 66.3)
    assert sharing.difference(50.0, None, span) == 0.0
    assert sharing.difference(70.0, None, span) == pytest.approx(3.7)
    assert sharing.difference(36.0, 37.56, None) == pytest.approx(-1.56)


def test_sim_saving_is_deterministic_and_gone_without_sharing(sharing) -> None:
    base = ["workload=alpaca", "workload.num_requests=30", "workload.arrival_rate=30",
            *sharing.sampling_overrides("beam", 4)]
    first, views, _ = sharing.sim_run(base)
    again, _, _ = sharing.sim_run(base)
    copied, _, _ = sharing.sim_run([*base, "allocator.share_blocks=false"])
    assert first["num_finished"] == 30
    assert 0.2 < first["kv_sharing_saving_mean"] < 0.75
    assert again["kv_sharing_saving_mean"] == first["kv_sharing_saving_mean"]
    assert copied["kv_sharing_saving_mean"] < first["kv_sharing_saving_mean"]
    assert len(views["by_time_decile_pct"]) == 10 and views["time_weighted_pct"] > 0


def test_sim_cli_writes_one_row_per_run(sharing, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "sharing.csv"
    monkeypatch.setattr(sys, "argv", [str(PATH), "sim", "--alpaca", "20", "30", "--sharegpt", "8", "2",
                                      "--widths", "2", "--out", str(out)])
    sharing.main()
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["workload"], r["mode"]) for r in rows] == [
        ("alpaca", "parallel"), ("alpaca", "beam"), ("sharegpt", "parallel"), ("sharegpt", "beam")
    ]
    assert "KV memory saved by sharing" in capsys.readouterr().out
