"""Workload sources: lengths, arrivals, traces, spec-only ids, max_model_len clipping, and prompt files
whose bad lines become aborts."""

import csv
import json
from importlib import resources

import numpy as np
import pytest

from paged.config import ConfigError, WorkloadConfig, validate
from paged.llm import compose_config
from paged.workload import load_workload


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _cfg(**kw) -> WorkloadConfig:
    base = {"name": "t", "kind": "synthetic", "num_requests": 400, "length_scale": 1.0,
            "prompt_len_max": 100_000, "output_len_max": 100_000, "prompt_len_min": 1, "output_len_min": 1}
    return WorkloadConfig(**{**base, **kw})


def test_synthetic_lengths_fit_sharegpt_means_and_respect_clipping():
    items = load_workload(_cfg(num_requests=4000), CharTokenizer())
    prompt_mean = np.mean([len(it.prompt_token_ids) for it in items])
    output_mean = np.mean([it.params.max_tokens for it in items])
    assert abs(prompt_mean - 161.31) / 161.31 < 0.1
    assert abs(output_mean - 337.99) / 337.99 < 0.1
    clipped = load_workload(_cfg(prompt_len_max=64, output_len_max=32, output_len_min=8), CharTokenizer())
    assert max(len(it.prompt_token_ids) for it in clipped) <= 64
    assert all(8 <= it.params.max_tokens <= 32 for it in clipped)


def test_synthetic_is_seeded_and_shared_prefix_is_shared():
    a = load_workload(_cfg(num_requests=5, shared_prefix_len=40), CharTokenizer())
    b = load_workload(_cfg(num_requests=5, shared_prefix_len=40), CharTokenizer())
    assert [it.prompt_token_ids for it in a] == [it.prompt_token_ids for it in b]
    assert len({tuple(it.prompt_token_ids[:40]) for it in a}) == 1


def test_poisson_arrivals_have_the_requested_rate():
    items = load_workload(_cfg(num_requests=2000, arrival_rate=4.0), CharTokenizer())
    times = [it.arrival_time for it in items]
    assert times == sorted(times)
    assert abs(len(times) / times[-1] - 4.0) < 0.4


def test_trace_replay_scales_lengths_and_time():
    cfg = _cfg(kind="trace", path="azure_code_2023.csv", num_requests=30, length_scale=0.1, time_scale=0.5,
               prompt_len_max=512, output_len_max=256)
    items = load_workload(cfg, CharTokenizer())
    assert len(items) == 30 and items[0].arrival_time == 0.0
    assert all(1 <= len(it.prompt_token_ids) <= 512 for it in items)
    with pytest.raises(FileNotFoundError, match="shipped traces: azure_code_2023.csv, azure_conv_2023.csv"):
        load_workload(_cfg(kind="trace", path="nope.csv"), CharTokenizer())


def test_prompt_file_bad_lines_become_errors_and_good_lines_survive(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0.5, "seed": 3}),
        json.dumps({"prompt": "", "max_tokens": 4}),
        json.dumps({"prompt": "x", "max_tokens": 0}),
        "{not json",
        json.dumps({"prompt": "x", "max_tokns": 3}),
        json.dumps({"prompt": 5}),
        json.dumps({"prompt": "ok", "n": 2, "priority": 2}),
    ]
    path.write_text("\n".join(lines) + "\n")
    items = load_workload(_cfg(kind="prompts", path=str(path)), CharTokenizer())
    assert len(items) == 7
    assert items[0].error is None and items[0].params.temperature == 0.5 and items[0].params.seed == 3
    assert items[1].error is None and items[1].prompt_token_ids == []  # the engine aborts it: empty prompt
    assert "max_tokens must be a positive integer, got 0" in items[2].error
    assert "not valid JSON" in items[3].error
    assert "unknown keys ['max_tokns']" in items[4].error
    assert "'prompt' must be a string" in items[5].error
    assert items[6].params.n == 2 and items[6].priority == 2


@pytest.mark.parametrize(
    ("workload", "prompt_mean", "output_mean", "rate"),
    [("sharegpt", 161.31, 337.99, 1.0), ("alpaca", 19.31, 58.45, 10.0)],
)
def test_paper_dataset_yamls_fit_the_paper_means_uncapped(workload, prompt_mean, output_mean, rate):
    cfg = compose_config([f"workload={workload}", "workload.num_requests=4000"]).workload
    assert (cfg.kind, cfg.length_scale, cfg.arrival_rate) == ("synthetic", 1.0, rate)
    assert cfg.prompt_len_max is None and cfg.output_len_max is None
    items = load_workload(cfg, None, vocab_size=32_000)
    assert abs(np.mean([len(it.prompt_token_ids) for it in items]) - prompt_mean) / prompt_mean < 0.1
    assert abs(np.mean([it.params.max_tokens for it in items]) - output_mean) / output_mean < 0.1


@pytest.mark.parametrize(
    "kw",
    [
        {"kind": "synthetic", "prompt_len_mean": 400, "output_len_mean": 400, "prompt_len_max": None,
         "output_len_max": None, "output_len_min": 300, "shared_prefix_len": 16},
        {"kind": "fixed", "prompt_len": 600, "output_len": 50, "shared_prefix_len": 16},
        {"kind": "trace", "path": "azure_code_2023.csv", "prompt_len_max": None, "output_len_max": None},
    ],
    ids=["synthetic", "fixed", "trace"],
)
def test_every_length_kind_is_clipped_to_max_model_len(kw):
    items = load_workload(_cfg(**kw), None, vocab_size=1000, max_model_len=256)
    prompt_lens = [len(it.prompt_token_ids) for it in items]
    assert max(prompt_lens) == 255  # the cap bites, leaving room for one generated token
    assert all(p + it.params.max_tokens <= 256 for p, it in zip(prompt_lens, items))


@pytest.mark.parametrize("tokenizer", [CharTokenizer(), None], ids=["tokenizer", "spec-only"])
def test_fixed_gives_exact_lengths_and_a_shared_prefix(tokenizer):
    cfg = _cfg(kind="fixed", num_requests=20, prompt_len=50, output_len=7, shared_prefix_len=30)
    items = load_workload(cfg, tokenizer, vocab_size=100)
    assert all(len(it.prompt_token_ids) == 50 and it.params.max_tokens == 7 for it in items)
    assert len({tuple(it.prompt_token_ids[:30]) for it in items}) == 1
    assert len({tuple(it.prompt_token_ids[30:]) for it in items}) == 20


def test_synthetic_ids_without_tokenizer_are_in_range_seeded_and_share_only_the_prefix():
    cfg = _cfg(num_requests=200, shared_prefix_len=24)
    items = load_workload(cfg, None, vocab_size=500)
    ids = [it.prompt_token_ids for it in items]
    assert all(isinstance(t, int) and 0 <= t < 500 for seq in ids for t in seq)
    assert ids == [it.prompt_token_ids for it in load_workload(cfg, None, vocab_size=500)]
    assert ids != [it.prompt_token_ids for it in load_workload(_cfg(num_requests=200, shared_prefix_len=24,
                                                                      seed=1), None, vocab_size=500)]
    assert len({tuple(seq[:24]) for seq in ids}) == 1
    bodies = [tuple(seq[24:]) for seq in ids if len(seq) > 24 + 8]
    assert len(set(bodies)) == len(bodies)


def test_spec_only_model_needs_vocab_size_and_cannot_read_prompt_files(tmp_path):
    with pytest.raises(ValueError, match="needs vocab_size="):
        load_workload(_cfg(), None)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="workload=prompts needs a model with a tokenizer"):
        load_workload(_cfg(kind="prompts", path=str(path)), None, vocab_size=100)


def test_num_requests_null_replays_the_whole_trace_at_full_scale():
    cfg = compose_config(["workload=trace", "workload.path=azure_code_2023.csv", "workload.num_requests=null",
                          "workload.length_scale=1", "workload.time_scale=1", "workload.prompt_len_max=null",
                          "workload.output_len_max=null"])
    validate(cfg)
    # a short max_model_len keeps the ids few (the trace's prompts average ~2k tokens)
    items = load_workload(cfg.workload, None, vocab_size=1000, max_model_len=64)
    with resources.files("paged.data").joinpath("traces/azure_code_2023.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(items) == len(rows)
    assert [it.arrival_time for it in items] == [float(r["arrived_at"]) - float(rows[0]["arrived_at"]) for r in rows]
    assert [len(it.prompt_token_ids) for it in items] == [min(max(4, int(r["num_prefill_tokens"])), 63) for r in rows]
    with pytest.raises(ConfigError, match="num_requests=null .* only allowed for workload=trace"):
        validate(compose_config(["workload.num_requests=null"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("workload.prompt_len=0", "workload.prompt_len=0 must be > 0"),
        ("workload.output_len=-1", "workload.output_len=-1 must be > 0"),
        ("workload.shared_prefix_len=513", r"workload.shared_prefix_len=513 must be in \[0, workload.prompt_len=512\]"),
        ("workload.arrival_rate=-2", "workload.arrival_rate=-2.0 must be >= 0"),
    ],
)
def test_bad_fixed_values_raise_config_error_naming_the_key(override, message):
    cfg = compose_config(["workload=fixed", override])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
