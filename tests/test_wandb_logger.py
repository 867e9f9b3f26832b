"""The W&B sink against a recording fake `wandb` module: what reaches `wandb.init`, the per-request
table and histograms, the outputs artifact, the sweep report, and that W&B failures only warn."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from paged.config import LoggerConfig, compose_config
from paged.engine.metrics import RequestMetrics
from paged.experiment.run import run_experiment
from paged.experiment.wandb_logger import WandbLogger, log_report

LATENCY_COLUMNS = ["ttft_s", "tpot_s", "e2e_latency_s", "normalized_latency_s_per_token"]


@dataclasses.dataclass
class Calls:
    init: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    logged: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    artifacts: list[Any] = dataclasses.field(default_factory=list)
    finished: int = 0


class Table:
    def __init__(self, columns: list[str], data: list[list[Any]], **_: Any) -> None:
        self.columns, self.data = columns, data


class Image:
    def __init__(self, path: str) -> None:
        self.path = path


class Artifact:
    def __init__(self, name: str, type: str) -> None:
        self.name, self.type, self.files = name, type, {}

    def add_file(self, local_path: str, name: str) -> None:
        self.files[name] = Path(local_path).read_text()


def fake_wandb(monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> Calls:
    """Installs a `wandb` that records every call; `fail` names the one call ("init", "log") that raises."""
    calls = Calls()

    def check(call: str) -> None:
        if call == fail:
            raise RuntimeError(f"{call} broke")

    class Run:
        id = "abc123"

        def __init__(self) -> None:
            self.summary = types.SimpleNamespace(update=calls.summary.update)

        def define_metric(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log(self, data: dict[str, Any]) -> None:
            check("log")
            calls.logged.append(data)

        def log_artifact(self, artifact: Artifact) -> None:
            calls.artifacts.append(artifact)

        def finish(self) -> None:
            calls.finished += 1

    def init(**kwargs: Any) -> Run:
        check("init")
        calls.init.append(kwargs)
        return Run()

    def histogram(table: Table, value: str, title: str) -> tuple[str, Table, str, str]:
        return ("histogram", table, value, title)

    module = types.ModuleType("wandb")
    module.__dict__.update(
        init=init, Settings=lambda **_: None, Table=Table, Image=Image, Artifact=Artifact,
        plot=types.SimpleNamespace(histogram=histogram),
    )
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return calls


def wandb_cfg(**overrides: Any) -> LoggerConfig:
    return LoggerConfig(**{"name": "wandb", "backend": "wandb", "mode": "offline", **overrides})


def sim_cfg(num_requests: int) -> Any:
    """A simulated run of a few short requests (a fraction of a second) that logs to W&B."""
    return compose_config([
        "executor=sim", "logger=wandb", "progress=false", "model=llama-2-7b", "workload=fixed",
        f"workload.num_requests={num_requests}", "workload.output_len=4",
    ])


def request_metrics() -> list[RequestMetrics]:
    done = RequestMetrics("r0", 8, 4, "length", None, 0.1, 0.02, 0.16, 0.04, 0)
    aborted = RequestMetrics("r1", 8, 0, "abort", "too long", None, None, None, None, 1)
    return [done, dataclasses.replace(done, request_id="r2", ttft_s=0.3, num_preemptions=2), aborted]


def test_name_group_job_type_and_clipped_tags_reach_init(monkeypatch, tmp_path):
    calls = fake_wandb(monkeypatch)
    long_tag = "workload.path=" + "d" * 80 + "/sharegpt.json"
    cfg = wandb_cfg(tags=["paper"])
    WandbLogger(cfg, tmp_path, {"seed": 0}, group="sweep-1", name="a=1", job_type="paged/v1", tags=["a=1", long_tag])
    (init,) = calls.init
    assert (init["group"], init["name"], init["job_type"], init["mode"]) == ("sweep-1", "a=1", "paged/v1", "offline")
    assert init["dir"] == str(tmp_path) and init["config"] == {"seed": 0}
    paper, swept, clipped = init["tags"]
    assert (paper, swept) == ("paper", "a=1")
    # W&B's limit; the swept key and the value's distinguishing end both survive
    assert len(clipped) == 64 and clipped.startswith("workload.path=d") and clipped.endswith("d/sharegpt.json")


def test_finish_logs_summary_request_table_histograms_and_outputs_artifact(monkeypatch, tmp_path):
    calls = fake_wandb(monkeypatch)
    (tmp_path / "summary.json").write_text('{"num_requests": 3}')
    (tmp_path / "requests.jsonl").write_text('{"request_id": "r0"}\n')
    logger = WandbLogger(wandb_cfg(), tmp_path, {}, name="allocator=paged,block_size=16")
    metrics = request_metrics()
    logger.finish({"num_requests": 3, "ttft_mean_s": None}, metrics, tmp_path)

    assert calls.summary == {"num_requests": 3}
    (logged,) = calls.logged
    table = logged["requests"]
    assert table.columns == [f.name for f in dataclasses.fields(RequestMetrics)]
    assert {"request_id", "finish_reason", "num_preemptions", *LATENCY_COLUMNS} <= set(table.columns)
    assert table.data == [list(dataclasses.asdict(m).values()) for m in metrics]
    for column in LATENCY_COLUMNS:
        kind, values, value, _ = logged[f"hist/{column}"]
        # the aborted request has no latency and stays out of the histogram
        assert (kind, values.columns, value) == ("histogram", [column], column)
        assert values.data == [[getattr(m, column)] for m in metrics[:2]]
    (artifact,) = calls.artifacts
    assert (artifact.name, artifact.type) == ("allocator_paged_block_size_16", "run-outputs")
    assert artifact.files == {"summary.json": '{"num_requests": 3}', "requests.jsonl": '{"request_id": "r0"}\n'}
    assert calls.finished == 1


def test_run_experiment_hands_request_metrics_and_outputs_to_wandb(monkeypatch, tmp_path):
    calls = fake_wandb(monkeypatch)
    run_experiment(sim_cfg(num_requests=3), tmp_path, group="sweep", name="job", tags=["workload=fixed"])
    assert calls.init[0]["tags"] == ["workload=fixed"] and calls.init[0]["name"] == "job"
    (table,) = [data["requests"] for data in calls.logged if "requests" in data]
    assert len(table.data) == 3 and table.columns[0] == "request_id"
    (artifact,) = calls.artifacts
    assert artifact.files["summary.json"] == (tmp_path / "summary.json").read_text()
    assert len(artifact.files["requests.jsonl"].splitlines()) == 3
    assert calls.finished == 1


def test_log_report_logs_one_image_per_png_and_the_results_table(monkeypatch, tmp_path):
    calls = fake_wandb(monkeypatch)
    images = [tmp_path / "throughput.png", tmp_path / "latency.png"]
    rows = [{"allocator": "paged", "tput": 10.0}, {"allocator": "static", "tput": None}]
    cfg = {"backend": "wandb", "mode": "offline", "project": "paged", "entity": None, "tags": ["paper"]}
    log_report(cfg, tmp_path / "report", images, rows, group="sweep-1")

    (init,) = calls.init
    assert (init["job_type"], init["name"], init["group"]) == ("report", "report", "sweep-1")
    assert init["dir"] == str(tmp_path / "report") and init["tags"] == ["paper"]
    (logged,) = calls.logged
    assert {k: v.path for k, v in logged.items() if k != "results"} == {
        "throughput": str(images[0]), "latency": str(images[1])
    }
    assert logged["results"].columns == ["allocator", "tput"]
    assert logged["results"].data == [["paged", 10.0], ["static", None]]
    assert calls.finished == 1


@pytest.mark.parametrize("fail", ["init", "log"])
def test_a_failing_wandb_only_warns_and_the_experiment_completes(monkeypatch, tmp_path, caplog, fail):
    calls = fake_wandb(monkeypatch, fail=fail)
    with caplog.at_level(logging.WARNING, logger="paged.experiment.wandb_logger"):
        summary = run_experiment(sim_cfg(num_requests=2), tmp_path)
    assert summary["num_finished"] == 2 and (tmp_path / "summary.json").is_file()
    assert f"{fail} broke" in caplog.text
    if fail == "log":
        # the failed step and table logs lose only themselves: the run gets its artifact and is finished
        assert len(calls.artifacts) == 1 and calls.finished == 1
    else:
        assert calls.artifacts == [] and calls.finished == 0


def test_a_failing_report_only_warns_and_still_finishes(monkeypatch, tmp_path, caplog):
    calls = fake_wandb(monkeypatch, fail="log")
    cfg = {"backend": "wandb", "mode": "offline", "project": "paged", "entity": None, "tags": []}
    with caplog.at_level(logging.WARNING, logger="paged.experiment.wandb_logger"):
        log_report(cfg, tmp_path, [], [{"a": 1}], group="sweep")
    assert "log broke" in caplog.text and calls.finished == 1


@pytest.mark.parametrize("env_mode, cfg", [
    ("disabled", wandb_cfg()),
    (None, wandb_cfg(mode="disabled")),
    (None, wandb_cfg(backend="none")),
])
def test_disabled_wandb_is_never_imported(monkeypatch, tmp_path, caplog, env_mode, cfg):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    if env_mode is not None:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now raises, and the failure would warn
    with caplog.at_level(logging.WARNING, logger="paged.experiment.wandb_logger"):
        logger = WandbLogger(cfg, tmp_path, {})
        logger.finish({"x": 1}, request_metrics(), tmp_path)
        log_report(dataclasses.asdict(cfg), tmp_path, [], [{"a": 1}], group="sweep")
    assert logger.run is None and caplog.text == ""
