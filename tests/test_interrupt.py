"""Stopping a run on SIGINT / SIGTERM (issue 30): `drive` stops between steps on its flag, the
unfinished requests are aborted as "interrupted", the finished keep their outputs, and `run.py`
writes the partial summary.json and requests.jsonl and exits 130 / 143."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from paged.api.outputs import print_summary, write_outputs
from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import INTERRUPTED, drive
from paged.experiment.summary import summarize
from paged.request import FinishReason, Request, SamplingParams
from paged.utils.interrupt import Interrupt
from tests.engine_helpers import make_engine
from tests.token_cache_executor import TokenCacheExecutor

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parent.parent
TINY = ("model=tiny-random", "logger=none", "progress=false")


def _request(request_id: str, max_tokens: int, arrival_time: float = 0.0) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), arrival_time=arrival_time)


# -- drive's stop flag, in process -------------------------------------------------------------------


@pytest.mark.serial("asserts the run stops within 10 s")
def test_a_stop_between_steps_aborts_the_unfinished_keeps_the_finished_and_submits_no_more() -> None:
    engine, stop = make_engine(), Interrupt()
    quick = _request("quick", 2)
    slow = [_request(f"slow-{i}", 100) for i in range(3)]
    late = _request("late", 4, arrival_time=30.0)
    # set inside a step, as a signal arriving mid-step would: drive must finish the step first
    engine.metrics.step_listeners.append(lambda record: record.engine_step == 5 and stop.request())
    start = time.perf_counter()
    assert drive(engine, [quick, *slow, late], stop=stop) is True
    assert time.perf_counter() - start < 10  # it did not wait for `late`
    assert quick.finish_reason is FinishReason.LENGTH and len(quick.outputs()[0].token_ids) == 2
    for r in slow:
        assert (r.finish_reason, r.abort_reason) == (FinishReason.ABORTED, INTERRUPTED)
        assert 0 < len(r.outputs()[0].token_ids) < 100 and r.finish_time is not None
    assert late not in engine.metrics.requests and late.finish_time is None
    assert not engine.has_unfinished and engine.kv_stats().num_allocated_blocks == 0


@pytest.mark.serial("asserts the stop is seen within 2 s")
def test_a_stop_while_idle_until_a_far_arrival_is_seen_at_once() -> None:
    engine, stop = make_engine(), Interrupt()
    timer = threading.Timer(0.2, stop.request)
    timer.start()
    start = time.perf_counter()
    try:
        assert drive(engine, [_request("late", 4, arrival_time=20.0)], stop=stop) is True
    finally:
        timer.cancel()
    assert time.perf_counter() - start < 2
    assert engine.metrics.requests == []


def test_drive_runs_to_the_end_and_says_so_when_no_stop_comes() -> None:
    engine = make_engine()
    requests = [_request(f"r{i}", 3) for i in range(3)]
    assert drive(engine, requests, stop=Interrupt()) is False
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)


def test_a_run_stopped_before_any_request_still_summarizes_and_writes(tmp_path: Path) -> None:
    cfg = compose_config(list(TINY))
    engine, stop = build_engine(cfg, executor=TokenCacheExecutor()), Interrupt()
    stop.request(signal.SIGTERM)
    requests = [_request(f"r{i}", 3) for i in range(3)]
    assert drive(engine, requests, stop=stop) is True
    summary = summarize(cfg, engine, host_time_s=0.01, load_time_s=0.0, num_not_started=3, interrupted=True)
    assert (summary["interrupted"], summary["num_requests"], summary["num_finished"]) == (True, 3, 0)
    assert (summary["num_aborted"], summary["num_not_started"]) == (0, 3)
    assert summary["ttft_mean_s"] is None and summary["output_tokens_per_s"] == 0.0
    write_outputs(tmp_path, summary, [], [], None)
    assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] is True
    assert (tmp_path / "requests.jsonl").read_text() == ""
    console = Console(file=io.StringIO(), width=120)
    print_summary(summary, "stopped", console)
    assert "not started" in console.file.getvalue()


def test_a_normal_run_says_it_was_not_interrupted() -> None:
    cfg = compose_config(list(TINY))
    engine = build_engine(cfg, executor=TokenCacheExecutor())
    drive(engine, [_request("r0", 3)])
    summary = summarize(cfg, engine)
    assert (summary["interrupted"], summary["num_not_started"], summary["num_requests"]) == (False, 0, 1)


# -- the signal handlers -------------------------------------------------------------------------------


def test_a_signal_while_catching_sets_the_flag_and_the_old_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = Interrupt()
    with stop.catching():
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
    assert (stop.signal_name, stop.exit_code) == ("SIGTERM", 143)
    assert signal.getsignal(signal.SIGTERM) is before


def test_catching_outside_the_main_thread_installs_nothing() -> None:
    seen = []

    def body() -> None:
        with Interrupt().catching():
            seen.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]


def test_a_second_signal_quits_at_once_without_going_on() -> None:
    code = (
        "import os, signal\n"
        "from paged.utils.interrupt import Interrupt\n"
        "with Interrupt().catching():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('went on')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130
    assert "went on" not in proc.stdout
    assert "SIGINT again: quitting now" in proc.stderr


# -- run.py, as a user (or a cluster's time limit) stops it ---------------------------------------------


def _run_and_signal(
    out_dir: Path, sig: int, *overrides: str, num_requests: int = 40, multirun: bool = False
) -> tuple[int, str]:
    """Start `python run.py`, whose requests arrive over ~20 s, send `sig` once its progress bar
    shows two finished requests, and return its exit code and stderr."""
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    cmd = [
        sys.executable, "run.py", *(["-m"] if multirun else []), "model=tiny-random", "logger=none", "progress=true",
        f"workload.num_requests={num_requests}", "workload.arrival_rate=2", "workload.length_scale=0.1",
        "workload.output_len_max=8", *overrides, f"{dir_key}={out_dir}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=dict(os.environ, WANDB_MODE="disabled"), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    chunks: list[str] = []

    def read_stderr() -> None:  # drained as it comes, so that a full pipe never blocks the run
        while chunk := os.read(proc.stderr.fileno(), 4096):
            chunks.append(chunk.decode(errors="replace"))

    reader = threading.Thread(target=read_stderr)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            done = re.findall(rf"\| *(\d+)/{num_requests} ", "".join(chunks))
            if done and int(done[-1]) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "".join(chunks)[-2000:]
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
        proc.stderr.close()
    return rc, "".join(chunks)


def _check_partial_run(run_dir: Path, num_requests: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    finished, aborted, not_started = summary["num_finished"], summary["num_aborted"], summary["num_not_started"]
    assert finished >= 2 and not_started >= 1
    assert finished + aborted + not_started == summary["num_requests"] == num_requests
    lines = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == finished + aborted
    for line in lines:
        if line["finish_reason"] == "aborted":
            assert line["abort_reason"] == INTERRUPTED
        else:
            assert line["finish_reason"] == "length" and line["output_len"] == len(line["output_token_ids"]) > 0
    assert sum(line["finish_reason"] != "aborted" for line in lines) == finished
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    return summary


def test_sigint_mid_run_writes_the_partial_results_and_exits_130(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rc, stderr = _run_and_signal(run_dir, signal.SIGINT)
    assert rc == 130, stderr[-2000:]
    _check_partial_run(run_dir, 40)
    assert stderr.rstrip().splitlines()[-1].endswith(f"interrupted by SIGINT: partial results in {run_dir}")
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_sigterm_mid_run_writes_the_partial_results_and_exits_143(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rc, stderr = _run_and_signal(run_dir, signal.SIGTERM)
    assert rc == 143, stderr[-2000:]
    _check_partial_run(run_dir, 40)
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_sigint_in_a_sweep_writes_the_current_job_and_stops_the_sweep(tmp_path: Path) -> None:
    from paged.report import build_report

    sweep = tmp_path / "sweep"
    rc, stderr = _run_and_signal(sweep, signal.SIGINT, "workload.seed=0,1", multirun=True)
    assert rc == 130, stderr[-2000:]
    jobs = sorted(p for p in sweep.iterdir() if (p / ".hydra").is_dir())
    assert [p.name.split("_")[0] for p in jobs] == ["0"]  # the second job never started
    _check_partial_run(jobs[0], 40)
    assert "the sweep stops here" in stderr and "Traceback" not in stderr
    # the report of what finished still builds, later
    report = build_report(sweep, tmp_path / "report", console=Console(file=io.StringIO()))
    assert [row.get("interrupted") for row in report.rows] == [True]
