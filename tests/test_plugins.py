"""A user's own allocator, policy, reservation and executor, each one Python file (tests/toy_plugins.py)
plus one YAML in the user's own config folder on `hydra.searchpath`, run by `run.py` unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged.request import SamplingParams
from tests.engine_helpers import make_engine, outputs, run_requests
from tests.test_cli import TINY, read_requests, run_cli

pytestmark = pytest.mark.subprocess

YAMLS = {
    "allocator/capped.yaml": """
name: capped
_target_: tests.toy_plugins.CappedAllocator
block_size: 8
num_blocks: 256
max_blocks: 12
""",
    "scheduler/prompt-length.yaml": """
name: prompt-length
max_num_seqs: 1
policy:
  _target_: tests.toy_plugins.PromptLengthPolicy
  longest_first: true
""",
    "executor/token-cache.yaml": """
name: token-cache
_target_: tests.toy_plugins.ToyExecutor
vocab_size: 50
""",
}
WORKLOAD = ("workload.num_requests=5", "workload.length_scale=0.1", "workload.output_len_max=12")


@pytest.fixture
def user_conf(tmp_path: Path) -> str:
    conf = tmp_path / "my_conf"
    for name, text in YAMLS.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text.lstrip())
    return f"hydra.searchpath=[file://{conf}]"


def test_user_plugins_from_a_searchpath_folder_run_with_their_settings(tmp_path: Path, user_conf: str) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        run_dir, user_conf, "allocator=capped", "scheduler=prompt-length", "executor=token-cache",
        "logger=none", "progress=false", *WORKLOAD,
    )
    assert proc.returncode == 0, proc.stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["allocator_class"] == "tests.toy_plugins.CappedAllocator"
    assert summary["policy_class"] == "tests.toy_plugins.PromptLengthPolicy"
    assert summary["executor_class"] == "tests.toy_plugins.ToyExecutor"
    assert (summary["num_finished"], summary["kv_blocks_in_use_end"]) == (5, 0)
    assert summary["num_total_blocks"] == 12  # max_blocks=12 of the 256 blocks in the cache
    requests = read_requests(run_dir)
    assert all(t < 49 for r in requests for t in r["output_token_ids"])  # vocab_size=50, EOS 49 never sampled
    # longest_first with one sequence at a time: first tokens come in descending prompt length
    by_first_token = sorted(requests, key=lambda r: r["ttft_s"])
    assert [r["prompt_len"] for r in by_first_token] == sorted((r["prompt_len"] for r in requests), reverse=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("allocator.max_blocks=abc", "allocator.max_blocks: Value 'abc' of type 'str' could not be converted"),
        ("+allocator.bogus=1", "allocator.bogus=1 is not a setting of CappedAllocator (its settings: max_blocks)"),
        ("~allocator.max_blocks", "allocator.max_blocks is required by CappedAllocator but not set"),
        ("scheduler.policy.longest_first=maybe", "scheduler.policy.longest_first: Value 'maybe' is not a valid bool"),
    ],
)
def test_bad_plugin_setting_fails_before_the_model_loads(tmp_path: Path, user_conf: str, override, message) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        run_dir, user_conf, "allocator=capped", "scheduler=prompt-length", "model=smollm2-135m", override,
        "logger=none", "progress=false",
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "model smollm2-135m on" not in (run_dir / "run.log").read_text()  # ModelExecutor never started
    assert not (run_dir / "summary.json").exists()


def test_setting_out_of_range_is_a_config_error_naming_the_plugin(tmp_path: Path, user_conf: str) -> None:
    proc = run_cli(
        tmp_path / "run", user_conf, "allocator=capped", "allocator.max_blocks=0", "executor=token-cache", *TINY
    )
    assert proc.returncode == 2
    assert "allocator._target_='tests.toy_plugins.CappedAllocator': max_blocks must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_executor_target_names_the_key_value_and_expected_base(tmp_path: Path, user_conf: str) -> None:
    proc = run_cli(tmp_path / "run", user_conf, *TINY, "executor._target_=tests.toy_plugins.CappedAllocator")
    assert proc.returncode == 2
    assert (
        "executor._target_='tests.toy_plugins.CappedAllocator' is not a subclass of Executor; "
        "expected the import path of a paged.executor.base.Executor subclass"
    ) in proc.stderr


def test_reservation_plugin_reserves_max_model_len_without_changing_outputs() -> None:
    prompts = [[i + 1] * (5 + 3 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=6 + i, ignore_eos=True, temperature=0.0) for i in range(6)]
    paged = make_engine("allocator=naive", "allocator.block_size=8")
    orca = make_engine(
        "allocator=naive", "allocator.block_size=8", "scheduler.max_model_len=64",
        "allocator.reservation._target_=tests.toy_plugins.ReserveMaxLen",
        "+allocator.reservation.max_model_len=${scheduler.max_model_len}",
    )
    assert outputs(run_requests(orca, prompts, params)) == outputs(run_requests(paged, prompts, params))
    paged_steps, orca_steps = paged.metrics.steps, orca.metrics.steps
    # every admitted sequence holds 64 / 8 = 8 blocks from admission on, most of them empty
    assert max(s.num_allocated_blocks for s in orca_steps) == 6 * 8
    orca_fraction = min(s.token_state_fraction for s in orca_steps if s.num_allocated_blocks)
    paged_fraction = min(s.token_state_fraction for s in paged_steps if s.num_allocated_blocks)
    assert orca_fraction < 0.25 < paged_fraction
    assert orca.kv_stats().num_allocated_blocks == 0
