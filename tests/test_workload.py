"""Workload sources: lengths, arrivals, traces, and prompt files whose bad lines become aborts."""

import json

import numpy as np
import pytest

from paged.config import WorkloadConfig
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
