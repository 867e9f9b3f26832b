"""Config and workload errors fail in check_config, before any weights load, as one ConfigError (or
FileNotFoundError) naming the key; lengths the user gives must fit scheduler.max_model_len, and
sampled lengths that do not are clipped with one warning."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from paged.config import ConfigError, compose_config
from paged.engine.builder import check_config
from paged.workload import load_workload, prompt_file
from tests.test_cli import TINY, run_cli, write_prompts

pytestmark = pytest.mark.subprocess


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]


def check(*overrides: str) -> None:
    check_config(compose_config([*TINY, *overrides]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.temperature=-0.5"], r"workload\.temperature=-0\.5 .*temperature must be >= 0"),
        (["workload.n=0"], r"workload\.n=0 .*n must be an integer >= 1, got 0"),
        (["workload.use_beam_search=true"], r"workload\.use_beam_search=true .*beam width .* got n=1"),
        (["workload.n=2", "workload.best_of=1"], r"workload\.best_of=1 .*best_of must be >= n"),
        (["workload.length_penalty=2.0"], r"workload\.length_penalty=2\.0 .*only applies to beam search"),
        (["workload=fixed", "workload.n=0"], r"workload\.n=0"),
    ],
)
def test_bad_sampling_keys_fail_before_the_model_loads(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check(*overrides)


def test_a_prompt_file_on_a_spec_only_model_is_refused_by_name(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigError, match="workload=prompts needs a tokenizer.*model=opt-13b is spec-only"):
        check("executor=sim", "model=opt-13b", "workload=prompts", f"workload.path={path}")
    check("executor=sim", "workload=prompts", f"workload.path={path}")  # a model with weights has a tokenizer


def test_model_device_cuda_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.device=cuda but this torch .* sees no CUDA device"):
        check("model.device=cuda")
    check("model.device=cuda", "executor=sim")  # the simulator runs no model on a device


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.num_requests=100000000"], "workload.num_requests=100000000 is more than 1,000,000"),
        (["workload.num_requests=1000001"], "workload.num_requests=1000001 is more than 1,000,000"),
        (["workload.num_requests=0"], "workload.num_requests=0 must be > 0"),
    ],
)
def test_num_requests_is_bounded(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check(*overrides)


def test_a_missing_prompt_file_is_named() -> None:
    with pytest.raises(FileNotFoundError, match="workload.path='/no/such.jsonl': no such prompt file"):
        check("workload=prompts", "workload.path=/no/such.jsonl")


def test_a_folder_is_no_prompt_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such prompt file"):
        check("workload=prompts", f"workload.path={tmp_path}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_prompt_file_is_named(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    path.chmod(0)
    with pytest.raises(ConfigError, match=f"workload.path='{path}': the prompt file cannot be read"):
        check("workload=prompts", f"workload.path={path}")


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank"])
def test_an_empty_prompt_file_is_an_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match="the prompt file has no prompts"):
        check("workload=prompts", f"workload.path={path}")


def test_a_prompt_file_of_only_bad_lines_names_the_first_reason(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.jsonl", ["{not json", {"prompt": 3}, {"prompt": "x", "colour": 1}])
    with pytest.raises(ConfigError) as err:
        check("workload=prompts", f"workload.path={path}")
    assert str(err.value) == (
        f"workload.path='{path}': none of its 3 prompt lines can run; the first: line 1 is not valid JSON: "
        "Expecting property name enclosed in double quotes"
    )


def test_some_bad_prompt_lines_run_the_rest_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "a"}, "{not json", {"prompt": "b"}, {"prompt": 3}])
    check("workload=prompts", f"workload.path={path}")
    cfg = compose_config([*TINY, "workload=prompts", f"workload.path={path}"])
    with caplog.at_level(logging.WARNING, logger="paged.workload"):
        items = prompt_file(cfg.workload, CharTokenizer())
    assert [it.error is None for it in items] == [True, False, True, False]
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "2 of 4 prompt lines cannot run" in record.getMessage()
    assert "line 2 is not valid JSON" in record.getMessage()


@pytest.mark.parametrize(
    ("header", "rows", "message"),
    [
        ("a,b", ["1,2"], "must have the columns"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens", [], "has no rows"),
    ],
)
def test_a_bad_trace_fails_before_load(tmp_path: Path, header: str, rows: list[str], message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    with pytest.raises(ConfigError, match=message):
        check("workload=trace", f"workload.path={path}")


def test_a_missing_trace_lists_the_shipped_ones() -> None:
    with pytest.raises(FileNotFoundError, match="no such trace file; shipped traces: azure_code_2023.csv"):
        check("workload=trace", "workload.path=nope.csv")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload=fixed", "workload.prompt_len=4096"],
         "workload.prompt_len=4096 + workload.output_len=128 = 4224 tokens per request, more than "
         "scheduler.max_model_len=2048"),
        (["workload=fixed", "workload.prompt_len=1921"], "= 2049 tokens per request"),
        (["workload=fixed", "workload.prompt_len=400", "scheduler.max_model_len=256"], "max_model_len=256"),
        (["executor=sim", "model=opt-13b", "workload=fixed", "workload.prompt_len=4096"], "= 4224 tokens"),
        (["workload.prompt_len_min=1500", "workload.output_len_min=600"],
         "workload.shared_prefix_len=0 + workload.prompt_len_min=1500 + workload.output_len_min=600 = 2100 tokens, "
         "more than scheduler.max_model_len=2048: no request of workload=synthetic would fit"),
        (["workload.shared_prefix_len=2048"], "workload.shared_prefix_len=2048 leaves no room to generate"),
        (["workload=trace", "workload.prompt_len_min=600", "scheduler.max_model_len=512"],
         "no request of workload=trace"),
    ],
)
def test_lengths_that_cannot_fit_max_model_len_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("+", r"\+").replace(".", r"\.")):
        check(*overrides)


def test_fixed_lengths_that_fit_exactly_pass() -> None:
    check("workload=fixed", "workload.prompt_len=1920", "workload.output_len=128")


@pytest.mark.parametrize("workload", ["sharegpt", "trace"])
def test_sampled_lengths_over_max_model_len_are_clipped_with_one_warning(
    workload: str, caplog: pytest.LogCaptureFixture
) -> None:
    extra = ["workload.length_scale=1", "workload.prompt_len_max=null", "workload.output_len_max=null"]
    cfg = compose_config([f"workload={workload}", "workload.num_requests=200", *(extra if workload == "trace" else [])])
    with caplog.at_level(logging.WARNING, logger="paged.workload"):
        items = load_workload(cfg.workload, None, vocab_size=1000, max_model_len=256)
    assert all(len(it.prompt_token_ids) + it.params.max_tokens <= 256 for it in items)
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    clipped = int(message.split(": ", 1)[1].split(" of ")[0])
    assert 0 < clipped <= 200 and "of 200 requests clipped to fit scheduler.max_model_len=256" in message
    assert "prompts cut to 255 tokens" in message


def test_lengths_that_fit_log_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = compose_config(["workload.num_requests=50"])  # capped at 512 + 256 tokens, under 2048
    with caplog.at_level(logging.WARNING, logger="paged.workload"):
        load_workload(cfg.workload, None, vocab_size=1000, max_model_len=2048)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.temperature=-0.5"], "error: workload.temperature=-0.5 "),
        (["workload=fixed", "workload.prompt_len=4096"], "error: workload.prompt_len=4096 + workload.output_len=128"),
        (["workload=prompts", "workload.path=/no/such.jsonl"], "error: workload.path='/no/such.jsonl'"),
        (["+experiment=fig2"], "error: experiment=fig2 is a sweep preset: run it with -m"),
    ],
)
def test_run_py_stops_before_loading_with_one_line_and_rc_2(tmp_path: Path, overrides: list[str], message: str) -> None:
    proc = run_cli(tmp_path / "run", *TINY, *overrides)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "KV cache" not in (tmp_path / "run" / "run.log").read_text()  # nothing was built
    assert not (tmp_path / "run" / "summary.json").exists()


def test_run_py_prompt_file_with_a_bad_line_warns_once_and_runs_the_rest(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "Hello", "max_tokens": 2}, "{oops"])
    proc = run_cli(tmp_path / "run", *TINY, "workload=prompts", f"workload.path={path}")
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "run.log").read_text()
    assert log.count("1 of 2 prompt lines cannot run") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["num_finished"], summary["num_aborted"]) == (1, 1)
