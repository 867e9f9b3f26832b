"""experiments/gpu/gpu_report.py without a GPU: its parsers, the outputs comparison, the budget, the benchmark
and job steps over faked or stand-in subprocesses, the markdown it renders (gpu_report_render.py) from
fabricated step results, the TTFT ratio, and its refusal on a machine without CUDA."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

PATH = Path(__file__).resolve().parents[1] / "experiments" / "gpu" / "gpu_report.py"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("gpu_report", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def render(report):
    """experiments/gpu/gpu_report_render.py, the records and the markdown, as gpu_report.py imported it."""
    return sys.modules["gpu_report_render"]


# -- pytest's output -------------------------------------------------------------------------------

PYTEST_OUTPUT = """\
..F.s.E
=================================== FAILURES ===================================
___________________________________ test_b ____________________________________
------------------------------ Captured log call -------------------------------
ERROR    paged:engine.py:12 a log line, not a test
=========================== short test summary info ============================
FAILED tests/test_kernels_cuda.py::test_b - assert 1 == 2
ERROR tests/test_kernels_cuda.py::test_e - RuntimeError: x
SKIPPED [27] tests/test_kernels_cuda.py:31: needs a CUDA device
1 failed, 4 passed, 27 skipped, 3 warnings, 2 errors in 112.34s (0:01:52)
"""


def test_pytest_counts_reads_the_summary_line_with_plurals_folded(report) -> None:
    assert report.pytest_counts(PYTEST_OUTPUT) == {"failed": 1, "passed": 4, "skipped": 27, "warning": 3, "error": 2}
    assert report.pytest_counts("==== 61 passed in 37.61s ====\n") == {"passed": 61}
    assert report.pytest_counts("5 deselected in 0.95s\n") == {"deselected": 5}


def test_pytest_counts_is_empty_without_a_summary_line(report) -> None:
    assert report.pytest_counts("..F.\n") == {}  # killed at its timeout
    assert report.pytest_counts("no tests ran in 0.01s\n") == {}
    assert report.pytest_counts("...\n3 tokens in 2s\n") == {}  # looks alike, but not pytest's words


def test_summary_lines_come_from_the_short_summary_only(report) -> None:
    assert report.summary_lines(PYTEST_OUTPUT, ("FAILED", "ERROR")) == [
        "FAILED tests/test_kernels_cuda.py::test_b - assert 1 == 2",
        "ERROR tests/test_kernels_cuda.py::test_e - RuntimeError: x",
    ]
    assert report.summary_lines(PYTEST_OUTPUT, ("SKIPPED",)) == [
        "SKIPPED [27] tests/test_kernels_cuda.py:31: needs a CUDA device"]


# -- requests.jsonl --------------------------------------------------------------------------------


def _write_requests(path: Path, outputs: dict[str, list[int]]) -> Path:
    # the fields around output_token_ids as paged/api/outputs.py writes them, so the reader ignores the rest
    lines = [json.dumps({"request_id": rid, "prompt_len": 5, "output_token_ids": ids, "finish_reason": "length",
                         "outputs": [{"index": 0, "output_token_ids": ids}]}) for rid, ids in outputs.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_outputs_maps_request_ids_to_token_ids(report, tmp_path: Path) -> None:
    path = _write_requests(tmp_path / "requests.jsonl", {"0": [1, 2, 3], "1": []})
    assert report.read_outputs(path) == {"0": [1, 2, 3], "1": []}


def test_compare_outputs_token_by_token(report) -> None:
    off = {"0": [1, 2, 3], "1": [4, 5, 6, 7], "2": [8], "3": [9, 9]}
    on = {"0": [1, 2, 3], "1": [4, 5, 0, 0], "2": [8], "3": [9, 9, 9], "4": [1]}
    c = report.compare_outputs(off, on)
    assert (c.requests, c.identical) == (5, 2)
    assert c.tokens == 3 + 4 + 1 + 3 + 1
    assert c.matching_tokens == 3 + 2 + 1 + 2 + 0
    assert c.first_difference == "request 1, token 2"


def test_compare_outputs_all_identical(report) -> None:
    c = report.compare_outputs({"a": [1, 2]}, {"a": [1, 2]})
    assert (c.requests, c.identical, c.tokens, c.matching_tokens, c.first_difference) == (1, 1, 2, 2, None)


# -- the budget and the steps ----------------------------------------------------------------------


def test_budget_keeps_the_later_steps_shares(report) -> None:
    fresh = report.Budget(1200.0)
    assert fresh.allowance(["bench", "job"]) == pytest.approx(1200 * report.SHARES["tests"], abs=1)
    late = report.Budget(1200.0, start=time.monotonic() - 1000)
    assert late.allowance([]) == pytest.approx(200, abs=1)


def test_steps_over_budget_are_skipped_not_run(report) -> None:
    args = argparse.Namespace(skip_tests=False, skip_bench=True, skip_job=False)
    spent = report.Budget(60.0, start=time.monotonic() - 60)
    results = report.run_steps(args, spent)
    assert results["bench"] == report.Skipped("--skip-bench")
    assert all(isinstance(results[s], report.Skipped) and "over budget" in results[s].reason
               for s in ("tests", "job"))


def test_run_command_kills_at_the_timeout_and_keeps_the_output(report) -> None:
    run = report.run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                             timeout_s=2)
    assert run.returncode is None and not run.ok
    assert run.stdout == "started\n" and run.wall_s < 30


def test_run_bench_runs_each_benchmark_whatever_became_of_the_one_before(report, monkeypatch) -> None:
    # the first hangs past its share and is killed; the second still gets the rest and is reported
    monkeypatch.setattr(report, "BENCHES", (
        ("decode attention", ["-c", "import time; print('decode', flush=True); time.sleep(60)"], 0.5),
        ("prefill attention", ["-c", "import sys; print('prefill'); sys.exit(1)"], 0.5),
    ))
    bench = report.run_bench(timeout_s=4)
    assert [r.label for r in bench.runs] == ["decode attention", "prefill attention"]
    decode, prefill = (r.run for r in bench.runs)
    assert decode.returncode is None and decode.stdout == "decode\n" and decode.timeout_s == pytest.approx(2, abs=0.5)
    assert prefill.returncode == 1 and prefill.stdout == "prefill\n" and prefill.timeout_s > 1
    assert bench.wall_s == pytest.approx(decode.wall_s + prefill.wall_s)


def test_the_benchmarks_are_kernel_bench_prefill_bench_then_the_host_overhead_on_cuda(report) -> None:
    scripts = [script for _, script, _ in report.BENCHES]
    assert scripts == [["experiments/gpu/kernel_bench.py", "--repeats", "5", "--shapes", *report.DECODE_SHAPES,
                        "--peers", "sdpa-flash", "sdpa-cudnn", "flashinfer"],
                       ["experiments/gpu/prefill_bench.py", "--device", "cuda", "--repeats", "5"],
                       ["experiments/host_overhead.py", "--real-driver"]]
    # the v3 targets' shapes come first, and every H100 table row of docs/gpu.md is there
    assert report.DECODE_SHAPES[:3] == ("64x4096", "256x1024", "1x16384")
    assert set(report.DECODE_SHAPES) == {"1x512", "1x4096", "1x16384", "16x1024", "16x16384", "64x4096", "256x1024",
                                         "256x16384"}
    assert sum(share for _, _, share in report.BENCHES) == pytest.approx(1)
    assert sum(report.SHARES.values()) == pytest.approx(1)


def test_run_job_runs_the_torch_kernels_as_the_default_and_compares_them(report, render, monkeypatch) -> None:
    """Subprocesses faked: each writes the summary and outputs a run of run.py would, into its hydra dir."""
    commands = []

    def fake_run(command: list[str], timeout_s: float):
        commands.append(command)
        run_dir = Path(next(a for a in command if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True)
        torch_kernels = "kernel.backend=torch" in command
        tok_s = 4000.0 if "executor=sim" in command else 3500.0 if "model=llama-3-8b-random" in command else 900.0
        (run_dir / "summary.json").write_text(json.dumps(_summary(tok_s, None, ttft=1.2 if torch_kernels else 0.3)))
        _write_requests(run_dir / "requests.jsonl", {"0": [1, 2, 3], "1": [4, 5] if torch_kernels else [4, 6]})
        return report.CommandRun(command, 0, "", "", 1.0, timeout_s)

    monkeypatch.setattr(report, "run_command", fake_run)
    job = report.run_job(timeout_s=500, hardware="h200")
    assert [r.label for r in job.runs] == [label for label, _ in report.JOB_RUNS]
    assert job.ratio == ("cuda-fp32-graphs-on", "cuda-fp32-graphs-off")  # the table's ratio column
    overrides = dict(report.job_runs("h200"))
    # the CUDA default (its dtype, graphs on) but for the kernels: only the backend differs
    assert overrides["cuda-torch-kernels"] == [*overrides["cuda-default"], "kernel.backend=torch"]
    assert not any(a.startswith(("model.dtype", "executor.cuda_graphs")) for a in overrides["cuda-default"])
    # the compared fp32 runs share their workload (16 requests); the load runs differ in the kernel only
    assert all("workload.num_requests=16" in overrides[label] for pair in report.COMPARED[:3] for label in pair)
    # async on (CUDA's default) against off: only the scheduling differs
    assert overrides["cuda-fp32-async-off"] == [*overrides["cuda-fp32-graphs-on"], "scheduler.async_scheduling=false"]
    assert overrides["cuda-load-v3"] == [*overrides["cuda-load-auto"], "kernel=v3"]
    assert "scheduler.max_num_seqs=256" in overrides["cuda-load-auto"]
    # the real Llama-3-8B shape and the simulator's run the same workload; the simulator on this GPU's preset
    real, simulated = overrides["cuda-llama-3-8b-random"], overrides["sim-llama-3-8b"]
    assert [a for a in real if a.startswith("workload")] == [a for a in simulated if a.startswith("workload")]
    assert simulated[-1] == "hardware=h200" and "executor=sim" in simulated
    assert len(commands) == len(report.JOB_RUNS)
    assert all(c[1] == "run.py" and "logger=none" in c for c in commands)
    compared = {(a, b): o for a, b, o in job.outputs}
    assert set(compared) == set(report.COMPARED)
    assert (compared["cuda-default", "cuda-torch-kernels"].identical, compared["cpu-fp32", "cuda-fp32-graphs-on"]
            .identical) == (1, 2)
    assert job.ttft == report.TtftRatio("cuda-torch-kernels", "cuda-default", 3.0)
    assert render.ttft_ratio(job) == pytest.approx((4.0, 1.2, 0.3))
    assert render.sim_error(job) == pytest.approx(-0.125)


def test_without_a_simulator_preset_for_the_gpu_the_simulated_run_is_left_out(report) -> None:
    assert "sim-llama-3-8b" not in dict(report.job_runs(None))
    assert len(report.job_runs(None)) == len(report.JOB_RUNS) - 1


@pytest.mark.parametrize(("gpu", "memory", "preset"), [
    ("NVIDIA H200", 139.8, "h200"), ("NVIDIA H100 80GB HBM3", 79.1, "h100-sxm"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40g"), ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80g"),
    ("NVIDIA L4", 22.0, "l4"), ("NVIDIA GeForce RTX 4090", 24.0, None),
])
def test_the_simulator_runs_on_the_preset_of_this_gpu(report, gpu: str, memory: float, preset: str | None) -> None:
    assert report.sim_hardware(gpu, memory) == preset


def test_the_real_run_is_stated_against_the_simulators_with_its_error(report, render) -> None:
    def run(label: str, summary: dict | None):
        return report.JobRun(label, _run(report, ["run.py"], 0 if summary else 1), summary)

    sim = report.SimComparison("cuda-llama-3-8b-random", "sim-llama-3-8b", 0.15)
    real = {**_summary(3500.0, None, ttft=2.0), "tpot_mean_s": 0.0110}
    simulated = {**_summary(4000.0, None, ttft=1.6), "tpot_mean_s": 0.0100}
    job = report.JobResult([run("cuda-default", _summary(900.0, None)), run("cuda-llama-3-8b-random", real),
                            run("sim-llama-3-8b", simulated)], [], None, None, sim)
    (line, _) = render.render_sim(job)
    assert line == ("cuda-llama-3-8b-random against the simulator's sim-llama-3-8b (same model shape and workload): "
                    "output tok/s 3500 vs 4000 (-12.5%); TPOT mean 11.00 ms vs 10.00 ms (+10.0%); TTFT mean 2.000 s vs "
                    "1.600 s (+25.0%); output tok/s **within 15%** of the simulator's (the simulator prices GPU work "
                    "only: the gap is the engine's host cost).")
    assert "; cuda-llama-3-8b-random vs the simulator: -12.5% tok/s" in render._outcome(job)
    # no ratio pair given: the last run over the first, as before
    assert "| output tokens/s | 900.0 | 3500.0 | 4000.0 | 4.44 |" in render.render_job(job)
    failed = report.JobResult([run("cuda-llama-3-8b-random", None), run("sim-llama-3-8b", simulated)], [], sim=sim)
    assert render.render_sim(failed)[0].endswith("not measured (a run is missing or wrote no throughput).")


# -- the markdown ----------------------------------------------------------------------------------


def _run(report, command: list[str], returncode: int | None, stdout: str = "", stderr: str = "",
         wall_s: float = 10.0):
    return report.CommandRun([sys.executable, *command], returncode, stdout, stderr, wall_s, timeout_s=300.0)


def _environment(report):
    return report.Environment(
        gpu="NVIDIA H100 80GB HBM3", memory_gib=79.1, capability=(9, 0), multiprocessors=132,
        driver="580.159.04", torch="2.11.0+cu130", cuda="13.0", nvrtc="13.0",
        packages={"cuda-core": "1.2.2", "cuda-bindings": "13.3.1"}, python="3.11.7", commit="8be5c32",
        dirty=True, date=datetime(2026, 11, 24, 13, 5, tzinfo=timezone(timedelta(hours=1))),
    )


BENCH_OUTPUT = """\
NVIDIA H100 80GB HBM3: L2 50 MiB, device-to-device copy 2427 GB/s (±0%)
 batch  context dtype    kv      v1 µs     ±   v1 %
     1      512  fp16     =       24.1   ±1%     4%
"""


PREFILL_OUTPUT = """\
NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, bfloat16, block 16; median of 5, ms per layer call
workload                       sdpa-flash     cuda cuda eager    torch flash TF/s cuda TF/s cuda/flash torch/cuda
16 seqs x 512                       0.100    0.150      0.250    2.500      100.0      66.7        67%     10.00x

cuda / sdpa-flash throughput, lowest: 67% (SmolLM2-135M, 16 seqs x 512); target >= 50%: met
"""


def _bench(report, prefill_code: int = 0, prefill_stderr: str = ""):
    return report.BenchResult([
        report.BenchRun("decode attention", _run(report, ["experiments/gpu/kernel_bench.py", "--repeats", "5"], 0,
                                                 stdout=BENCH_OUTPUT)),
        report.BenchRun("prefill attention", _run(
            report, ["experiments/gpu/prefill_bench.py", "--device", "cuda", "--repeats", "5"], prefill_code,
            stdout=PREFILL_OUTPUT, stderr=prefill_stderr)),
    ])


def _summary(tok_s: float, graph_steps: int | None, ttft: float = 0.985) -> dict:
    summary = {"output_tokens_per_s": tok_s, "tpot_mean_s": 0.0202, "tpot_p99_s": 0.03, "itl_mean_s": 0.02,
               "itl_p99_s": 0.04, "ttft_mean_s": ttft, "wall_time_s": 5.83, "host_time_s": 6.1,
               "load_time_s": 2.0, "num_finished": 48, "num_engine_steps": 300,
               "attention_kernel": "cuda v1/v2 auto", "executor_description": "SmolLM2-135M on cuda"}
    if graph_steps is not None:
        summary |= {"cuda_graph_steps": graph_steps, "eager_decode_steps": 300 - graph_steps}
    return summary


JOB_TITLE = ("3. The default job: CUDA graphs off / on, CUDA / CPU, our kernels / torch's; under load; "
             "Llama-3-8B's shape against the simulator")
BENCH_TITLE = "2. Kernel benchmarks: decode, prefill; host overhead"


def test_render_report_from_fabricated_results(report) -> None:
    env = _environment(report)
    tests = report.TestsResult(
        _run(report, ["-m", "pytest", "-q", "tests/test_kernels_cuda.py"], 1,
             stdout="...F\nFAILED tests/test_kernels_cuda.py::test_b - assert 1 == 2\n1 failed, 60 passed in 37s\n"),
        counts={"failed": 1, "passed": 60, "skipped": 2},
        problems=["FAILED tests/test_kernels_cuda.py::test_b - assert 1 == 2"],
        skips=["SKIPPED [2] tests/test_kernels_cuda.py:31: needs sm_90"],
    )
    bench = _bench(report)
    off = _run(report, ["run.py", "executor.cuda_graphs=false"], 0)
    on = _run(report, ["run.py", "executor.cuda_graphs=true"], 0)
    job = report.JobResult(
        runs=[report.JobRun("graphs-off", off, _summary(900.0, None)),
              report.JobRun("graphs-on", on, _summary(1350.0, 280))],
        outputs=[("graphs-off", "graphs-on", report.OutputComparison(
            requests=48, identical=47, tokens=6632, matching_tokens=6600, first_difference="request 7, token 12"))],
    )
    text = report.render_report(env, tests, bench, job, budget_min=20)

    lines = text.splitlines()
    assert lines[0] == "# GPU report: NVIDIA H100 80GB HBM3"
    assert "2026-11-24, commit 8be5c32 (dirty)" in lines[2]
    assert "| 1. CUDA tests | 1 failed, 60 passed, 2 skipped | 10 s |" in lines
    assert f"| {BENCH_TITLE} | decode attention ok; prefill attention ok | 20 s |" in lines
    assert (f"| {JOB_TITLE} | graphs-off 900.0 tok/s / graphs-on 1350.0 "
            "tok/s; graphs-off vs graphs-on: 47/48 requests identical | 20 s |") in lines
    # the environment
    assert "| driver | 580.159.04 |" in lines
    assert "| compute capability | 9.0 (sm_90), 132 SMs |" in lines
    assert "| torch | 2.11.0+cu130 (CUDA 13.0) |" in lines
    assert "| cuda-core | 1.2.2 |" in lines
    assert "| commit | 8be5c32 (with uncommitted changes) |" in lines
    assert "| date | 2026-11-24T13:05+01:00 |" in lines
    # sections in order, each with its wall time
    headings = [line for line in lines if line.startswith("## ")]
    assert headings == ["## Environment", "## 1. CUDA tests (10 s)", f"## {BENCH_TITLE} (20 s)",
                        f"## {JOB_TITLE} (20 s)"]
    assert "`python -m pytest -q tests/test_kernels_cuda.py`: exit 1, 10.0 s (timeout 300 s)" in lines
    assert "| failed | passed | skipped |" in lines and "| 1 | 60 | 2 |" in lines
    assert "SKIPPED [2] tests/test_kernels_cuda.py:31: needs sm_90" in lines
    assert text.count("FAILED tests/test_kernels_cuda.py::test_b") == 2  # the list, and the output's tail
    # each benchmark's output verbatim, in order under its heading
    assert "```\n" + BENCH_OUTPUT + "```" in text and "```\n" + PREFILL_OUTPUT + "```" in text
    assert lines.index("### Decode attention") < text.splitlines().index("### Prefill attention")
    assert ("`python experiments/gpu/prefill_bench.py --device cuda --repeats 5`: exit 0, 10.0 s (timeout 300 s)"
            in lines)
    # the job: both runs side by side, the ratio, the new counters where present
    assert "| metric | graphs-off | graphs-on | graphs-on / graphs-off |" in lines
    assert "| output tokens/s | 900.0 | 1350.0 | 1.50 |" in lines
    assert "| TPOT mean (ms) | 20.20 | 20.20 | 1.00 |" in lines
    assert "| CUDA-graph steps | - | 280 | - |" in lines
    assert "| eager decode steps | - | 20 | - |" in lines
    assert "| attention | cuda v1/v2 auto | cuda v1/v2 auto |  |" in lines
    assert ("Outputs of graphs-off and graphs-on: **47 of 48 requests** have identical output token ids (6600 of "
            "6632 tokens agree up to each request's first difference); the first difference: request 7, token 12.") \
        in lines
    assert "stderr's tail" not in text


def test_render_report_with_failures_timeouts_and_skips(report) -> None:
    env = _environment(report)
    tests = report.TestsResult(_run(report, ["-m", "pytest"], None, stdout="..\n", wall_s=300.0), {}, [], [])
    failed = report.JobRun("graphs-on", _run(report, ["run.py"], 2, stderr="Traceback\nerror: no cuda_graphs\n"), None)
    job = report.JobResult(
        runs=[report.JobRun("graphs-off", _run(report, ["run.py"], 0), _summary(900.0, None)), failed], outputs=[])
    text = report.render_report(env, tests, report.Skipped("--skip-bench"), job, budget_min=20)

    lines = text.splitlines()
    assert "| 1. CUDA tests | no pytest summary (timed out) | 300 s |" in lines
    assert "`python -m pytest`: killed at its timeout, 300 s" in lines
    assert "```\n..\n```" in text  # what it printed before it was killed
    assert f"| {BENCH_TITLE} | skipped: --skip-bench | - |" in lines
    assert f"## {BENCH_TITLE}" in lines and "Skipped: --skip-bench." in lines
    assert "| output tokens/s | 900.0 | - | - |" in lines
    assert "graphs-on, stderr's tail:" in lines and "error: no cuda_graphs" in lines
    assert "Outputs:" not in text


def test_a_failed_benchmark_is_reported_beside_the_others_output(report) -> None:
    bench = _bench(report, prefill_code=1, prefill_stderr="Traceback\nRuntimeError: no kernel image\n")
    text = report.render_report(_environment(report), report.Skipped("--skip-tests"), bench,
                                report.Skipped("--skip-job"), budget_min=20)
    lines = text.splitlines()
    assert (f"| {BENCH_TITLE} | decode attention ok; prefill attention exit 1, 10.0 s "
            "(timeout 300 s) | 20 s |") in lines
    assert "```\n" + BENCH_OUTPUT + "```" in text and "```\n" + PREFILL_OUTPUT + "```" in text
    assert text.count("stderr's tail:") == 1 and "RuntimeError: no kernel image" in lines
    assert text.index("### Prefill attention") < text.index("stderr's tail:")


def _ttft_job(report, torch_kernels_summary: dict | None):
    ours = report.JobRun("cuda-default", _run(report, ["run.py", "model.device=cuda"], 0), _summary(2000.0, 290, 0.3))
    theirs = report.JobRun("cuda-torch-kernels", _run(report, ["run.py", "kernel.backend=torch"],
                                                      0 if torch_kernels_summary else 1), torch_kernels_summary)
    return report.JobResult([ours, theirs], [], report.TtftRatio("cuda-torch-kernels", "cuda-default", 3.0))


def test_render_job_states_the_ttft_ratio_against_its_target(report, render) -> None:
    met = render.render_job(_ttft_job(report, _summary(700.0, None, 1.05)))
    assert ("TTFT mean of cuda-torch-kernels over cuda-default (the same prompts): **3.50x** (1.050 s / 0.300 s); "
            "the target, at least 3x lower with our kernels: met.") in met
    assert "| TTFT mean (s) | 0.300 | 1.050 | 3.50 |" in met
    short = render.render_job(_ttft_job(report, _summary(700.0, None, 0.6)))
    assert any("**2.00x**" in line and line.endswith("NOT met.") for line in short)
    overview = report.render_report(_environment(report), report.Skipped("x"), report.Skipped("x"),
                                    _ttft_job(report, _summary(700.0, None, 1.05)), budget_min=20)
    assert "; TTFT cuda-torch-kernels / cuda-default: 3.50x | " in overview


def test_render_job_says_when_the_ttft_ratio_is_not_measured(report, render) -> None:
    lines = render.render_job(_ttft_job(report, None))
    assert "TTFT mean of cuda-torch-kernels over cuda-default: not measured (a run wrote no TTFT)." in lines
    assert "cuda-torch-kernels, stderr's tail:" in lines


def test_report_name_is_the_date_and_the_gpu(report) -> None:
    assert report.report_name(_environment(report)) == "2026-11-24-nvidia-h100-80gb-hbm3.md"


# -- no GPU ----------------------------------------------------------------------------------------


def test_refuses_without_cuda_in_one_line(tmp_path: Path) -> None:
    # no device visible, so this holds on a GPU machine too instead of starting the whole agenda
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, str(PATH), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("gpu_report: no CUDA device: torch ")
    assert not out.exists()
