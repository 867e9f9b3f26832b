"""Sweep reports (`paged/report`): results.csv, repeats, the sustainable rate, the paper comparison,
the errors for unreadable folders, and a real sweep through each launcher ending in its report."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from paged.config import register_configs
from paged.engine.builder import check_config
from paged.report import ReportError, build_report
from paged.report.__main__ import main as report_main
from paged.report.compare import PaperPoint, compare
from paged.report.plots import PlotSpec
from paged.report.ratio import Ratio, ratios
from paged.report.sustainable import Sustainable, crossing, sustainable_rates
from paged.report.sweep import group_name, num_jobs, sweep_choices, tags
from paged.utils.atomic_file import OutputError
from tests.test_cli import REPO, run_cli

pytestmark = pytest.mark.subprocess

SIM = ("executor=sim", "model=opt-13b", "workload=sharegpt", "workload.num_requests=20", "logger=none",
       "progress=false")


def write_job(root: Path, name: str, overrides: list[str], summary: dict | None, *, report: dict | None = None,
              experiment: str | None = None, error: str | None = None) -> Path:
    """A job folder as Hydra and run.py leave it."""
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"report": report or {}, "seed": 0}))
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {
        "experiment": experiment}}}}))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (job / "error.json").write_text(json.dumps({"type": "ConfigError", "message": error}))
    return job


def metrics(tput: float, latency: float, **extra) -> dict:
    return {"output_throughput": tput, "normalized_latency_s_per_token": latency, "attention_kernel": "v1/cpu",
            **extra}


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_sweep_becomes_one_row_per_job_with_the_swept_keys_as_columns(tmp_path: Path) -> None:
    n = 0
    for alloc in ("naive", "prefix"):
        for rate in ("1", "2"):
            write_job(tmp_path, f"{n}_a", [f"allocator={alloc}", f"workload.arrival_rate={rate}", "logger=none"],
                      metrics(100 * n + 1, 0.1 * float(rate)))
            n += 1
    report = build_report(tmp_path)
    rows = read_csv(tmp_path / "results.csv")
    assert len(rows) == 4
    # logger=none is the same in every job: not a column
    assert list(rows[0])[:2] == ["allocator", "workload.arrival_rate"] and "logger" not in rows[0]
    assert [r["output_throughput"] for r in rows] == ["1", "101", "201", "301"]
    assert [(r["allocator"], r["workload.arrival_rate"]) for r in report.aggregated] == [
        ("naive", 1), ("naive", 2), ("prefix", 1), ("prefix", 2)]
    table = (tmp_path / "table.md").read_text()
    assert "| allocator | workload.arrival_rate |" in table
    # the default plots: the first metrics against the numeric swept key, one line per allocator
    assert {p.name for p in report.images} == {"output_throughput_vs_workload.arrival_rate.png",
                                               "normalized_latency_s_per_token_vs_workload.arrival_rate.png"}
    assert all(p.stat().st_size > 1000 for p in report.images)


def test_repeats_fold_into_median_and_spread(tmp_path: Path) -> None:
    values = {"v1": [10.0, 30.0, 20.0], "v2": [5.0, 6.0, 7.0]}
    n = 0
    for kernel, tputs in values.items():
        for repeat, tput in enumerate(tputs):
            write_job(tmp_path, f"{n}_j", [f"kernel={kernel}", f"repeat={repeat}"], metrics(tput, 0.1))
            n += 1
    report = build_report(tmp_path)
    assert len(report.rows) == 6
    v1, v2 = report.aggregated
    assert (v1["kernel"], v1["n"], v1["output_throughput"], v1["output_throughput_min"], v1["output_throughput_max"]) \
        == ("v1", 3, 20.0, 10.0, 30.0)
    assert v2["output_throughput"] == 6.0 and "repeat" not in v2
    assert v1["attention_kernel"] == "v1/cpu"  # text metrics are kept, not averaged
    table = (tmp_path / "table.md").read_text()
    assert "| kernel | n |" in table and "| v1 | 3 | 20 (10–30) |" in table


def test_no_summaries_names_each_job_and_why(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="no job folders"):
        build_report(tmp_path)
    write_job(tmp_path, "0_bad", ["allocator.num_blocks=0"], None, error="allocator.num_blocks=0 must be > 0")
    write_job(tmp_path, "1_killed", ["allocator.num_blocks=1"], None)
    with pytest.raises(ReportError) as e:
        build_report(tmp_path)
    assert "0_bad: ConfigError: allocator.num_blocks=0 must be > 0" in str(e.value)
    assert "1_killed: no summary.json" in str(e.value)
    with pytest.raises(ReportError, match="not a folder"):
        build_report(tmp_path / "missing")


def test_summaries_of_different_schemas_name_the_files(tmp_path: Path) -> None:
    write_job(tmp_path, "0_a", ["kernel=v1"], metrics(1, 0.1))
    write_job(tmp_path, "1_a", ["kernel=v2"], metrics(2, 0.1))
    write_job(tmp_path, "2_old", ["kernel=v1", "repeat=1"], {"output_tokens_per_s": 1.0})
    with pytest.raises(ReportError) as e:
        build_report(tmp_path)
    message = str(e.value)
    assert "2 different schemas" in message and "2_old/summary.json" in message and "0_a/summary.json" in message
    # a simulated job's own keys (sim_time_s, hardware, ...) are no different schema
    (tmp_path / "2_old" / "summary.json").write_text(json.dumps(metrics(3, 0.1, sim_time_s=1.0, hardware="a100")))
    assert len(build_report(tmp_path).rows) == 3
    # nor are a KV press's (kv_press=none writes none of them)
    (tmp_path / "2_old" / "summary.json").write_text(json.dumps(metrics(3, 0.1, kv_press="sink-window",
                                                                        kv_press_blocks_freed=8)))
    assert len(build_report(tmp_path).rows) == 3
    (tmp_path / "2_old" / "summary.json").write_text("[1, 2]")
    with pytest.raises(ReportError, match="2_old/summary.json: a summary is a JSON object"):
        build_report(tmp_path)


def test_failed_jobs_are_listed_and_the_others_reported(tmp_path: Path) -> None:
    write_job(tmp_path, "0_ok", ["allocator.num_blocks=64"], metrics(1, 0.1))
    write_job(tmp_path, "1_bad", ["allocator.num_blocks=0"], None, error="allocator.num_blocks=0 must be > 0")
    assert report_main([str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    table = (tmp_path / "out" / "table.md").read_text()
    assert "## Failed jobs" in table and "`1_bad`: ConfigError: allocator.num_blocks=0 must be > 0" in table
    assert len(read_csv(tmp_path / "out" / "results.csv")) == 1
    assert report_main([str(tmp_path / "missing")]) == 2


def test_crossing_interpolates_the_rate_where_latency_explodes() -> None:
    assert crossing([(1, 0.1), (2, 0.3), (3, 0.9)], 0.5) == (pytest.approx(2 + 0.2 / 0.6), "")
    assert crossing([(3, 0.9), (1, 0.1), (2, 0.3)], 0.5) == (pytest.approx(2 + 0.2 / 0.6), "")  # any order
    assert crossing([(1, 0.6), (2, 0.9)], 0.5) == (1, "<")
    assert crossing([(1, 0.1), (2, 0.2)], 0.5) == (2, ">=")


def test_sustainable_rate_ratios_per_group() -> None:
    rows = [{"model": m, "allocator": a, "rate": r, "lat": r * slope}
            for m in ("13b", "66b") for a, slope in (("orca", 0.5), ("paged", 0.125)) for r in (1, 2, 4, 8)]
    spec = Sustainable.from_config({"x": "rate", "line": "allocator", "metric": "lat", "threshold": 0.75,
                                    "baselines": ["orca"]})
    out = {(r["model"], r["allocator"]): r for r in sustainable_rates(rows, ["model", "allocator", "rate"], spec)}
    assert out["13b", "orca"]["sustainable_rate"] == pytest.approx(1.5)
    assert out["13b", "paged"]["sustainable_rate"] == pytest.approx(6.0)
    assert out["66b", "paged"]["sustainable_rate_ratio_over_orca"] == pytest.approx(4.0)
    # a system that never explodes within the sweep: its ratio is a lower bound, shown as one
    rows = [r | {"lat": r["lat"] / 10} if r["allocator"] == "paged" else r for r in rows]
    out = {(r["model"], r["allocator"]): r for r in sustainable_rates(rows, ["model", "allocator", "rate"], spec)}
    assert out["13b", "paged"]["sustainable_rate_ratio_over_orca"] == pytest.approx(8 / 1.5)
    assert out["13b", "paged"]["sustainable_rate_ratio_over_orca_bound"] == ">="
    point = PaperPoint.from_config({"label": "x", "metric": "sustainable_rate_ratio_over_orca",
                                    "where": {"model": "13b", "allocator": "paged"}, "range": [1.7, 2.7]})
    (row,) = compare([point], list(out.values()))
    assert (row["ours"], row["verdict"]) == (">= 5.333", "OUTSIDE")
    with pytest.raises(ReportError, match="'speed' is not a swept key"):
        sustainable_rates(rows, ["model", "allocator", "rate"], Sustainable("speed", "allocator"))
    with pytest.raises(ReportError, match="unknown key"):
        Sustainable.from_config({"x": "rate", "line": "allocator", "thresh": 1})


def test_ratio_to_a_baseline_per_configuration() -> None:
    rows = [{"mode": m, "block": b, "lat": lat} for m, b, lat in
            (("recompute", 8, 1.0), ("swap", 8, 1.5), ("recompute", 64, 2.0), ("swap", 64, 1.0), ("swap", 128, 3.0))]
    out = ratios(rows, ["mode", "block"], Ratio.from_config({"line": "mode", "baseline": "recompute", "metric": "lat"}))
    assert [(r["block"], r["lat_over_recompute"]) for r in out] == [(8, 1.5), (64, 0.5), (128, None)]
    with pytest.raises(ReportError, match="needs `line`"):
        Ratio.from_config({"baseline": "recompute"})


def test_compare_gives_the_difference_and_the_verdict() -> None:
    rows = [{"allocator": "orca-max", "share": 0.228}, {"allocator": "naive", "share": 0.985, "ratio": 3.1}]
    points = [PaperPoint.from_config(p) for p in (
        {"label": "max", "metric": "share", "where": {"allocator": "orca-max"}, "value": 20.4, "tolerance": 5,
         "scale": 100},
        {"label": "paged", "metric": "share", "where": {"allocator": "naive"}, "value": 90, "tolerance": 5,
         "scale": 100},
        {"label": "ratio", "metric": "ratio", "where": {"allocator": "naive"}, "range": [1.7, 2.7]},
        {"label": "none", "metric": "ratio", "where": {"allocator": "orca-max"}, "value": 1, "rel_tolerance": 0.1},
    )]
    out = {r["result"]: r for r in compare(points, rows)}
    assert out["max"]["ours"] == pytest.approx(22.8) and out["max"]["verdict"] == "within"
    assert out["max"]["difference"].startswith("+2.4")
    assert out["paged"]["verdict"] == "OUTSIDE"
    assert out["ratio"]["verdict"] == "OUTSIDE" and out["ratio"]["difference"] == "+0.4"
    assert out["none"]["verdict"].startswith("no row has ratio")
    with pytest.raises(ReportError, match="give `value` or `range"):
        PaperPoint.from_config({"label": "x", "metric": "m"})
    with pytest.raises(ReportError, match="unknown key"):
        PaperPoint.from_config({"label": "x", "metric": "m", "value": 1, "tolerence": 1})


def test_a_bad_report_config_names_the_key(tmp_path: Path) -> None:
    write_job(tmp_path, "0_a", ["kernel=v1"], metrics(1, 0.1), report={"plots": [{"x": "kernel", "y": "m",
                                                                                 "kind": "pie"}]})
    with pytest.raises(ReportError, match="kind='pie'; allowed: \\['line', 'stacked'\\]"):
        build_report(tmp_path)
    with pytest.raises(ReportError, match="unknown key"):
        PlotSpec.from_config({"x": "a", "y": "b", "colour": "red"})


def test_sweep_keys_counts_tags_and_group() -> None:
    swept = sweep_choices({"allocator": "naive,prefix", "workload.n": "2,4,6", "seed": "1"},
                          ["+load=sharegpt,alpaca", "allocator=orca-max", "repeat=range(0,3)"])
    # the command line wins over the preset's params; single values are not swept
    assert swept == {"workload.n": ["2", "4", "6"], "load": ["sharegpt", "alpaca"], "repeat": ["0", "1", "2"]}
    assert num_jobs(swept) == 18
    assert num_jobs({"x": None}) is None
    assert tags(swept, {"workload.n": "4", "load": "alpaca", "seed": "1"}) == ["workload.n=4", "load=alpaca"]
    assert group_name("fig13", swept) == "fig13"
    assert group_name(None, swept) == "sweep:workload.n,load"


EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_preset_composes_and_its_report_parses(name: str) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}"], return_hydra_config=True)
        params = OmegaConf.to_container(cfg.hydra.sweeper.params)
        assert params, f"{name} sweeps nothing"
        first = [f"{k}={str(v).split(',')[0]}" for k, v in params.items()]
        job = compose("config", overrides=[f"+experiment={name}", *first])
    check_config(job)  # every key, value and plugin setting, as run.py checks them before running
    report = OmegaConf.to_container(job.report)
    assert report["out"] == f"experiments/results/{name}"
    for plot in report["plots"]:
        PlotSpec.from_config(plot)
    for point in report["paper"]:
        PaperPoint.from_config(point)
    if report["sustainable"]:
        Sustainable.from_config(report["sustainable"])
    if report["ratio"]:
        Ratio.from_config(report["ratio"])


def test_an_unknown_experiment_lists_the_available_ones(tmp_path: Path) -> None:
    proc = run_cli(tmp_path / "run", "+experiment=fig99")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: experiment=fig99 is not an option; did you mean fig19?")
    assert "fig12-opt13b" in proc.stderr and "table1" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local", "ray"])
def test_a_sweep_reports_itself_at_the_end_and_lists_failed_jobs(tmp_path: Path, launcher: str) -> None:
    """Every launcher: the jobs run (one fails on a bad value), the callback writes results.csv with
    the others, table.md lists the failed one, and the sweep exits non-zero."""
    sweep = tmp_path / "sweep"
    extra = [] if launcher == "basic" else [f"hydra/launcher={launcher}"]
    if launcher == "submitit_local":
        extra += ["hydra.launcher.timeout_min=5"]
    if launcher == "ray":  # a local Ray instance, its jobs in Ray worker processes
        extra += ["+hydra.launcher.ray.init.include_dashboard=false"]
    proc = run_cli(sweep, *SIM, "workload.arrival_rate=1,4", "allocator.num_blocks=0,300", *extra, multirun=True,
                   timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    rows = read_csv(sweep / "results.csv")
    assert len(rows) == 2
    assert {r["workload.arrival_rate"] for r in rows} == {"1", "4"} and {r["allocator.num_blocks"] for r in rows} \
        == {"300"}
    assert all(int(r["num_finished"]) == 20 for r in rows)
    table = (sweep / "table.md").read_text()
    assert table.count("allocator.num_blocks=0 must be > 0") == 2
    assert "2 job(s) failed" in log
    if launcher == "basic":
        assert "sweep: 4/4 jobs done (2 failed)" in log  # progress, counted from the job folders


def test_the_index_orders_experiments_and_counts_verdicts(tmp_path: Path) -> None:
    from paged.report.index import build_index
    from paged.report.index import main as index_main

    for name in ("fig12-opt13b", "fig2", "table1", "cpu-swap"):
        write_job(tmp_path / "runs" / name, "0_a", ["allocator=naive", "x=1"], metrics(1, 0.1),
                  report={"paper": [{"label": "ok", "metric": "output_throughput", "where": {}, "value": 1,
                                     "tolerance": 0.5},
                                    {"label": "far", "metric": "output_throughput", "where": {}, "value": 9,
                                     "tolerance": 0.5}]})
        build_report(tmp_path / "runs" / name, tmp_path / "results" / name)
    page = build_index(tmp_path / "results")
    assert [line.split("]")[0] for line in page.splitlines() if line.startswith("| [")] == [
        "| [table1", "| [fig2", "| [fig12-opt13b", "| [cpu-swap"]
    assert "| [fig2](#fig2) | 1 | 1 |" in page
    assert "![output_throughput_vs_x](results/fig2/output_throughput_vs_x.png)" in page
    assert "`python run.py -m +experiment=fig12-opt13b`" in page and "### Against the paper" in page
    assert index_main([str(tmp_path / "missing")]) == 2


def test_a_report_folder_that_cannot_be_made_is_one_output_error(tmp_path: Path) -> None:
    write_job(tmp_path / "sweep", "0_a", ["allocator=naive"], metrics(1.0, 0.1))
    (tmp_path / "file").write_text("a file: no folder can be made under it")
    with pytest.raises(OutputError, match=r"^cannot write the report into .*file/out: Not a directory$"):
        build_report(tmp_path / "sweep", tmp_path / "file" / "out")
