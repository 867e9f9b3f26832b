"""`python run.py ...` as a user runs it: a subprocess from the repo root, outputs in a temp dir.

Every run uses the tiny random model and a handful of short requests; the W&B tests run with
WANDB_MODE unset and no credentials anywhere they could be read from, so nothing reaches the
network.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paged.engine.builder import DEFAULT_NUM_BLOCKS

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parent.parent
TINY = ("model=tiny-random", "logger=none", "progress=false")
CONTRACT_SUMMARY_KEYS = {
    "num_requests", "num_finished", "num_aborted", "num_preemptions", "output_tokens_per_s", "requests_per_s",
    "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "e2e_latency_mean_s", "normalized_latency_s_per_token",
    "kv_usage_mean", "token_state_fraction_mean", "prefix_cache_hit_rate", "wall_time_s",
}
CONTRACT_REQUEST_KEYS = {
    "request_id", "prompt_len", "output_token_ids", "output_text", "finish_reason", "ttft_s", "e2e_latency_s",
    "num_preemptions",
}
# 6 synthetic requests whose output lengths (seed 0) differ, so completion order != submission order
SMALL_WORKLOAD = ("workload.num_requests=6", "workload.length_scale=0.1", "workload.output_len_max=24")


def run_cli(
    out_dir: Path, *overrides: str, multirun: bool = False, env: dict[str, str | None] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """`python run.py [-m] overrides` with Hydra's run (or sweep) dir at `out_dir`; env None values unset."""
    full_env = dict(os.environ, WANDB_MODE="disabled")
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    cmd = [sys.executable, "run.py", *(["-m"] if multirun else []), *overrides, f"{dir_key}={out_dir}"]
    return subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def read_requests(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]


def write_prompts(path: Path, records: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    start = time.perf_counter()
    proc = run_cli(run_dir, *TINY, *SMALL_WORKLOAD)
    print(f"run.py model=tiny-random, 6 requests: {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_run_writes_summary_with_contract_keys_and_consistent_values(default_run: Path) -> None:
    summary = json.loads((default_run / "summary.json").read_text())
    assert CONTRACT_SUMMARY_KEYS <= set(summary)
    assert (summary["num_requests"], summary["num_finished"], summary["num_aborted"]) == (6, 6, 0)
    assert summary["kv_blocks_in_use_end"] == 0
    if not torch.cuda.is_available():  # with a GPU the cache is sized from its memory instead
        assert summary["num_total_blocks"] == DEFAULT_NUM_BLOCKS
    assert summary["prefix_cache_hit_rate"] is not None  # the default allocator caches prefixes
    assert 0 < summary["kv_usage_mean"] <= 1 and 0 < summary["token_state_fraction_mean"] <= 1

    requests = read_requests(default_run)
    num_output = sum(len(r["output_token_ids"]) for r in requests)
    wall = summary["wall_time_s"]
    assert wall == pytest.approx(max(r["e2e_latency_s"] for r in requests))
    assert summary["output_tokens_per_s"] * wall == pytest.approx(num_output)
    assert summary["requests_per_s"] * wall == pytest.approx(6)
    assert summary["ttft_mean_s"] == pytest.approx(statistics.mean(r["ttft_s"] for r in requests))
    assert summary["e2e_latency_mean_s"] == pytest.approx(statistics.mean(r["e2e_latency_s"] for r in requests))
    assert summary["normalized_latency_s_per_token"] == pytest.approx(
        statistics.mean(r["e2e_latency_s"] / len(r["output_token_ids"]) for r in requests)
    )


def test_requests_jsonl_has_one_line_per_request_in_submission_order(default_run: Path) -> None:
    from paged.config import compose_config
    from paged.model.locate import locate_smollm2
    from paged.model.tokenizer import load_tokenizer
    from paged.workload import load_workload

    tokenizer = load_tokenizer(locate_smollm2())
    items = load_workload(compose_config([*TINY, *SMALL_WORKLOAD]).workload, tokenizer)
    requests = read_requests(default_run)

    assert [r["request_id"] for r in requests] == [it.request_id for it in items]
    assert [r["prompt_len"] for r in requests] == [len(it.prompt_token_ids) for it in items]
    for record, item in zip(requests, items, strict=True):
        assert CONTRACT_REQUEST_KEYS <= set(record)
        assert record["finish_reason"] == "length" and "abort_reason" not in record
        assert len(record["output_token_ids"]) == item.params.max_tokens  # ignore_eos in the synthetic workload
        assert record["output_text"] == tokenizer.decode(record["output_token_ids"])
        assert record["num_preemptions"] == 0
        assert 0 < record["ttft_s"] <= record["e2e_latency_s"]
    completion_order = sorted(requests, key=lambda r: r["e2e_latency_s"])
    assert completion_order != requests  # so the file order above is not just the completion order


def test_multirun_sweep_writes_one_job_dir_per_combination(tmp_path: Path) -> None:
    workload = ("workload.num_requests=3", "workload.prompt_len_max=24", "workload.output_len_max=6")
    sweep = tmp_path / "sweep"
    proc = run_cli(sweep, "allocator=naive,prefix", "kernel=v1,v2", *TINY, *workload, multirun=True)
    assert proc.returncode == 0, proc.stderr

    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(jobs) == 4
    combos = set()
    for job in jobs:
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        allocator = "naive" if "allocator=naive" in overrides else "prefix"
        kernel = "v1" if "kernel=v1" in overrides else "v2"
        combos.add((allocator, kernel))
        summary = json.loads((job / "summary.json").read_text())
        assert summary["num_finished"] == 3 and summary["kv_blocks_in_use_end"] == 0
        assert summary["attention_kernel"].startswith(f"{kernel}/")
        assert (summary["prefix_cache_hit_rate"] is None) == (allocator == "naive")
    assert combos == {("naive", "v1"), ("naive", "v2"), ("prefix", "v1"), ("prefix", "v2")}
    # greedy decoding of one model: every allocator/kernel combination gives the same tokens
    outputs = [[r["output_token_ids"] for r in read_requests(job)] for job in jobs]
    assert all(o == outputs[0] for o in outputs[1:])


def test_unknown_group_option_fails_and_lists_available_options(tmp_path: Path) -> None:
    proc = run_cli(tmp_path / "run", *TINY, "allocator=nope")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: allocator=nope is not an option; "
        "the options of allocator: naive, orca-max, orca-oracle, orca-pow2, prefix"
    )
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("allocator.num_blocks=0", "allocator.num_blocks=0 must be > 0"),
        ("allocator.block_size=12", "allocator.block_size=12 is not supported; allowed: 8, 16, 32"),
    ],
)
def test_out_of_range_value_fails_naming_the_value_without_traceback(tmp_path: Path, override, message) -> None:
    proc = run_cli(tmp_path / "run", *TINY, override)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("override", ["allocator.block_size=abc", "allocator.blocksize=16"])
def test_wrong_type_or_unknown_key_is_rejected_by_the_schema(tmp_path: Path, override) -> None:
    proc = run_cli(tmp_path / "run", *TINY, override)
    assert proc.returncode != 0
    key = override.split("=")[0]
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_requests_are_aborted_with_reasons_while_good_ones_finish(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "prompts.jsonl", [
        {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True},
        {"prompt": "", "max_tokens": 4},
        {"prompt": "Hello there", "max_tokens": 0},
        {"prompt": "word " * 60, "max_tokens": 4},  # ~60 tokens, over max_model_len
        "{not json",
        {"prompt": "word " * 30, "max_tokens": 1},  # ~30 tokens: fits max_model_len, not the 3-block cache
        {"prompt": "One two three", "max_tokens": 3, "ignore_eos": True},
    ])
    proc = run_cli(
        tmp_path / "run", *TINY, "workload=prompts", f"workload.path={path}", "scheduler.max_model_len=32",
        "allocator.num_blocks=3", "allocator.block_size=8", "allocator.watermark=0",
    )
    assert proc.returncode == 0, proc.stderr

    requests = read_requests(tmp_path / "run")
    assert [r["finish_reason"] for r in requests] == ["length"] + ["aborted"] * 5 + ["length"]
    assert [len(r["output_token_ids"]) for r in requests] == [4, 0, 0, 0, 0, 0, 3]
    reasons = [r.get("abort_reason") for r in requests]
    assert reasons[0] is None and reasons[6] is None
    assert reasons[1] == "empty prompt"
    assert "max_tokens" in reasons[2] and "0" in reasons[2]
    assert "max_model_len=32" in reasons[3]
    assert "line 5 is not valid JSON" in reasons[4]
    assert "the cache has 3 blocks" in reasons[5]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["num_requests"], summary["num_finished"], summary["num_aborted"]) == (7, 2, 5)
    assert summary["kv_blocks_in_use_end"] == 0


def wandb_env(tmp_path: Path) -> dict[str, str | None]:
    """WANDB_MODE unset (the config decides), and no API key in the environment, a netrc or W&B's settings."""
    return {
        "WANDB_MODE": None, "WANDB_API_KEY": None, "WANDB_SILENT": "true",
        "NETRC": str(tmp_path / "no-netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }


def test_wandb_offline_writes_a_run_file_with_step_and_summary_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        run_dir, "model=tiny-random", "logger=wandb", "logger.mode=offline", "progress=false",
        "workload.num_requests=2", "workload.prompt_len_max=8", "workload.output_len_max=4", env=wandb_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert b"engine_step" in data and b"step/kv_usage" in data  # per-step metrics
    assert b"output_tokens_per_s" in data  # the final summary
    assert (run_dir / "summary.json").is_file()


def test_wandb_failure_is_a_warning_and_the_run_still_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    proc = run_cli(
        run_dir, "model=tiny-random", "logger=wandb", "logger.mode=online", "progress=false",
        "workload.num_requests=2", "workload.prompt_len_max=8", "workload.output_len_max=4",
        env=wandb_env(tmp_path), timeout=60,  # online W&B without a key must fail fast, not wait on the network
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "W&B disabled for this run" in (run_dir / "run.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["num_finished"] == 2
    assert not list(run_dir.glob("wandb/*run-*"))
    print(f"online W&B without an API key: run finished in {elapsed:.1f} s")
