"""The bad-input suite (issue 30): the ways a new user gets input wrong, each through a real entry
point, each ending in a one-line error raised before any weights load, or in one aborted request
while every other request of the same run finishes. Nothing ends in a traceback.

The focused tests beside it (test_config_typos, test_preload_checks, test_llm_inputs,
test_llm_vllm_compat, test_hf_checkpoint_checks, test_interrupt, test_atomic_write) pin each
mechanism; this table is the user's view across all of them, one row per mistake.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paged import LLM, BeamSearchParams, SamplingParams
from paged.config import ConfigError, check_command_line, compose_config
from paged.engine.builder import build_engine
from paged.experiment.run import run_quietly
from tests.test_cli import TINY, run_cli, write_prompts

pytestmark = pytest.mark.subprocess

# -- config and workload mistakes: one line, before any weights load ------------------------------

CONFIG_CASES: list[tuple[str, list[str], str]] = [
    # group 4: typos, with or without +, in every group
    ("typo-scheduler", ["+scheduler.max_num_seq=4"], "did you mean scheduler.max_num_seqs?"),
    ("typo-no-plus", ["scheduler.max_num_seq=4"], "did you mean scheduler.max_num_seqs?"),
    ("typo-kernel", ["+kernel.partiton_size=64"], "did you mean kernel.partition_size?"),
    ("typo-workload", ["+workload.num_request=3"], "did you mean workload.num_requests?"),
    ("typo-model", ["+model.dtyp=float16"], "did you mean model.dtype?"),
    ("typo-top-level", ["+foo=1"], "unknown key foo; top-level keys:"),
    ("typo-group", ["allocater=naive"], "did you mean allocator?"),
    ("typo-plugin-setting", ["allocator.num_blokcs=10"], "did you mean allocator.num_blocks?"),
    ("typo-option", ["allocator=prefixx"], "prefixx"),
    # wrong types and ranges (the existing checks)
    ("type-int", ["seed=abc"], "seed=abc"),
    ("type-float-count", ["workload.num_requests=2.5"], "workload.num_requests=2.5"),
    ("type-1e8", ["workload.num_requests=1e8"], "workload.num_requests=100000000.0"),
    ("block-size", ["allocator.block_size=12"], "allocator.block_size=12 is not supported; allowed: 8, 16, 32"),
    ("watermark", ["allocator.watermark=1.5"], "allocator.watermark=1.5 must be in [0, 1)"),
    ("gpu-util", ["allocator.gpu_memory_utilization=0"], "allocator.gpu_memory_utilization=0"),
    ("swap-space", ["allocator.swap_space=lots"], "allocator.swap_space"),
    ("both-sizes", ["allocator.num_blocks=64", "allocator.kv_cache_memory=1GiB"], "both size the KV cache"),
    ("kernel-version", ["kernel.version=v9"], "kernel.version='v9' is not supported"),
    ("partition", ["kernel.partition_size=100"], "kernel.partition_size=100 must be a multiple of"),
    ("kv-dtype", ["kernel.kv_cache_dtype=int4"], "kernel.kv_cache_dtype='int4' is not supported"),
    ("fp8-scale", ["kernel.k_scale=-1"], "kernel.k_scale"),
    ("model-dtype", ["model.dtype=float64"], "model.dtype='float64' is not supported"),
    ("num-threads", ["model.num_threads=0"], "model.num_threads=0"),
    ("sliding-window", ["model.sliding_window=-4"], "model.sliding_window=-4"),
    ("max-num-seqs", ["scheduler.max_num_seqs=0"], "scheduler.max_num_seqs=0 must be > 0"),
    ("no-chunk-budget", ["scheduler.chunked_prefill=false", "scheduler.max_num_batched_tokens=512"],
     "scheduler.max_num_batched_tokens=512 must be >="),
    ("arrival-rate", ["workload.arrival_rate=-1"], "workload.arrival_rate=-1"),
    ("client-weights", ["workload.num_clients=2", "workload.client_weights=[1]"], "one weight per client"),
    ("logger-mode", ["logger.mode=loud"], "logger.mode='loud' is not supported"),
    # group 5: sampling keys, impossible combinations and sizes, files, devices
    ("temperature", ["workload.temperature=-0.5"], "workload.temperature=-0.5"),
    ("n-zero", ["workload.n=0"], "workload.n=0"),
    ("beam-n1", ["workload.use_beam_search=true"], "workload.use_beam_search=true"),
    ("best-of-below-n", ["workload.n=2", "workload.best_of=1"], "workload.best_of=1"),
    ("num-requests-huge", ["workload.num_requests=100000000"], "is more than 1,000,000"),
    ("num-requests-zero", ["workload.num_requests=0"], "workload.num_requests=0 must be > 0"),
    ("prompts-without-path", ["workload=prompts"], "workload=prompts needs workload.path=FILE"),
    ("missing-prompt-file", ["workload=prompts", "workload.path=/no/such.jsonl"], "/no/such.jsonl"),
    ("sim-prompts", ["executor=sim", "model=opt-13b", "workload=prompts", "workload.path=/x.jsonl"],
     "model=opt-13b is spec-only"),
    ("hf-without-path", ["model=hf"], "model=hf needs model.path"),
    # group 7: a length the user set that does not fit max_model_len names both
    ("fixed-too-long", ["workload=fixed", "workload.prompt_len=4096"], "scheduler.max_model_len=2048"),
    ("prefix-over-prompt", ["workload=fixed", "workload.shared_prefix_len=600"], "workload.shared_prefix_len=600"),
]


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading weights fails the test: a config error must come before it."""
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("weights were loaded before the config error")

    monkeypatch.setattr("paged.executor.model_executor.load_weights", refuse)


def _one_line(err: BaseException) -> str:
    message = str(err)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize(("overrides", "fragment"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_a_config_mistake_is_one_line_before_any_weights_load(no_weights, overrides, fragment) -> None:
    argv = [*TINY, *overrides]
    with pytest.raises((ConfigError, FileNotFoundError)) as err:
        check_command_line(argv)  # run.py's first look, before Hydra
        build_engine(compose_config(argv))
    assert fragment in _one_line(err.value)


def test_a_sweep_preset_without_m_is_refused(tmp_path: Path) -> None:
    proc = run_cli(tmp_path / "run", *TINY, "+experiment=fig2")
    _assert_cli_error(proc, "experiment=fig2 is a sweep preset: run it with -m")


def test_an_empty_or_all_bad_prompt_file_is_refused(no_weights, tmp_path: Path) -> None:
    empty = write_prompts(tmp_path / "empty.jsonl", [])
    bad = write_prompts(tmp_path / "bad.jsonl", ["{not json", {"promt": "x"}])
    for path, fragment in ((empty, "empty"), (bad, "line 1 is not valid JSON")):
        with pytest.raises((ConfigError, FileNotFoundError)) as err:
            build_engine(compose_config([*TINY, "workload=prompts", f"workload.path={path}"]))
        assert fragment in _one_line(err.value)


# -- run.py: rc 2 and one line on stderr, also for what fails before or after our config checks ----

def _assert_cli_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["scheduler.max_num_seq=4"], "did you mean scheduler.max_num_seqs?"),
        (["workload=prompts", "workload.path=/no/such.jsonl"], "/no/such.jsonl"),
    ],
    ids=["typo", "missing-prompt-file"],
)
def test_run_py_says_one_line_and_exits_2(tmp_path: Path, args: list[str], fragment: str) -> None:
    _assert_cli_error(run_cli(tmp_path / "run", *TINY, *args), fragment)


def test_run_py_names_a_run_folder_it_cannot_make(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file, so no folder can be made under it (also for root)")
    _assert_cli_error(run_cli(tmp_path / "file" / "run", *TINY), "cannot create the run folder")


def test_run_py_names_a_broken_hf_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{broken")
    _assert_cli_error(run_cli(tmp_path / "run", *TINY, "model=hf", f"model.path={ckpt}"), "config.json")


# -- per request: the bad one is aborted with a reason, the rest of the run finishes --------------

# one prompt file: a good line between every two bad ones
BAD_LINES: list[tuple[str, Any, str]] = [
    ("not-json", "{oops", "is not valid JSON"),
    ("not-object", "[1, 2]", "is not a JSON object"),
    ("unknown-key", {"prompt": "hi", "max_token": 4}, "unknown keys ['max_token']"),
    ("prompt-not-str", {"prompt": 5}, "'prompt' must be a string"),
    ("max-tokens-type", {"prompt": "hi", "max_tokens": "4"}, "max_tokens must be"),
    ("temperature", {"prompt": "hi", "temperature": -1.0}, "temperature"),
    ("top-p", {"prompt": "hi", "top_p": 0.0}, "top_p"),
    ("priority-type", {"prompt": "hi", "priority": "high"}, "priority must be an integer"),
    ("too-long", {"prompt": "word " * 300, "max_tokens": 2000}, "more than max_model_len=512"),
    ("empty-prompt", {"prompt": ""}, "empty prompt"),
    ("best-of-over-seqs", {"prompt": "hi", "n": 2, "best_of": 40}, "max_num_seqs"),
]


def test_bad_prompt_lines_are_aborted_with_reasons_and_every_other_request_finishes(tmp_path: Path) -> None:
    good = {"prompt": "The capital of France is", "max_tokens": 4}
    lines: list[Any] = [good]
    for _, line, _ in BAD_LINES:
        lines += [line, good]
    path = write_prompts(tmp_path / "mixed.jsonl", lines)
    summary, engine = run_quietly(
        [*TINY, "workload=prompts", f"workload.path={path}", "scheduler.max_model_len=512",
         "scheduler.max_num_seqs=32"]
    )
    requests = {r.request_id: r for r in engine.metrics.requests}
    for i, (case, _, fragment) in enumerate(BAD_LINES):
        bad = requests[f"req-{2 * i + 1}"]
        assert bad.abort_reason is not None and fragment in bad.abort_reason, (case, bad.abort_reason)
        assert "\n" not in bad.abort_reason
    good_ones = [requests[f"req-{2 * i}"] for i in range(len(BAD_LINES) + 1)]
    assert all(r.abort_reason is None and r.finish_time is not None for r in good_ones)
    assert summary["num_finished"] == len(good_ones) and summary["num_aborted"] == len(BAD_LINES)


# -- the LLM API: a bad call changes nothing ------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=6)
LLM_CALLS: list[tuple[str, Callable[[LLM], Any], type[Exception], str]] = [
    ("id-too-big", lambda llm: llm.generate([[10**9]], GREEDY), ValueError, "outside the vocabulary"),
    ("id-negative", lambda llm: llm.generate([[-1, 5]], GREEDY), ValueError, "token id -1"),
    ("id-float", lambda llm: llm.generate([[1.5, 2]], GREEDY), TypeError, "token ids are ints"),
    ("bytes", lambda llm: llm.generate(b"hello", GREEDY), TypeError, "bytes"),
    ("none", lambda llm: llm.generate(None, GREEDY), TypeError, "prompts is None"),
    ("empty-list", lambda llm: llm.generate([], GREEDY), ValueError, "prompts is empty"),
    ("empty-str", lambda llm: llm.generate([""], GREEDY), ValueError, "prompt 0 is empty"),
    ("dict-keys", lambda llm: llm.generate([{"text": "hi"}], GREEDY), ValueError, "unknown key"),
    ("params-dict", lambda llm: llm.generate(["hi"], {"temperature": 0}), TypeError, "SamplingParams"),
    ("params-count", lambda llm: llm.generate(["a", "b"], [GREEDY] * 3), ValueError, "3 SamplingParams for 2"),
    ("bad-one-of-many", lambda llm: llm.generate(["fine", [10**9]], GREEDY), ValueError, "prompt 1"),
    ("priority", lambda llm: llm.generate(["hi"], GREEDY, priority=["high"]), ValueError, "priority"),
    ("beam-params", lambda llm: llm.beam_search(["hi"], GREEDY), TypeError, "BeamSearchParams"),
    ("chat-role", lambda llm: llm.chat([{"content": "hi"}], GREEDY), ValueError, "'role'"),
    ("sampling-range", lambda llm: llm.generate(["hi"], SamplingParams(top_k=-5)), ValueError, "top_k"),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random")


@pytest.mark.parametrize(("call", "error", "fragment"), [c[1:] for c in LLM_CALLS], ids=[c[0] for c in LLM_CALLS])
def test_a_bad_llm_call_is_one_line_and_submits_nothing(llm, call, error, fragment) -> None:
    before = len(llm.engine.metrics.requests)
    with pytest.raises(error) as err:
        call(llm)
    assert fragment in _one_line(err.value)
    assert len(llm.engine.metrics.requests) == before and not llm.engine.has_unfinished


def test_after_every_bad_call_the_llm_answers_as_a_fresh_one(llm) -> None:
    for _, call, error, _ in LLM_CALLS:
        with pytest.raises(error):
            call(llm)
    prompts = ["The capital of France is", [1, 2, 3, 4]]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in LLM("tiny-random").generate(prompts, GREEDY, use_tqdm=False)
    ]
    assert llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences


LLM_BUILDS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unknown-model", {"model": "smollm3"}, ConfigError, "smollm3"),
    ("unknown-kwarg", {"max_model_length": 512}, TypeError, "did you mean 'max_model_len'"),
    ("dtype", {"dtype": "float8"}, ConfigError, "float8"),
    ("tensor-parallel", {"tensor_parallel_size": 3}, ConfigError, "tensor_parallel_size=3 does not divide"),
    ("gpu-util", {"gpu_memory_utilization": 1.5}, ConfigError, "gpu_memory_utilization"),
    ("override-typo", {"overrides": ["+scheduler.max_num_seq=4"]}, ConfigError, "did you mean"),
]


@pytest.mark.parametrize(("kwargs", "error", "fragment"), [c[1:] for c in LLM_BUILDS], ids=[c[0] for c in LLM_BUILDS])
def test_a_bad_llm_argument_is_one_line_before_any_weights_load(no_weights, kwargs, error, fragment) -> None:
    kwargs = {"model": "tiny-random", **kwargs}
    with pytest.raises(error) as err:
        LLM(kwargs.pop("model"), **kwargs)
    assert fragment in _one_line(err.value)
