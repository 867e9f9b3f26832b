"""Workload sources: lengths, arrivals, traces, spec-only ids, max_model_len clipping, workload-level
sampling keys, and prompt files (every SamplingParams field, bad lines and bad bytes become aborts)."""

import csv
import json
from importlib import resources

import numpy as np
import pytest

from paged.config import ConfigError, WorkloadConfig, compose_config, validate
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
    assert items[2].error == "line 3: max_tokens must be an integer >= 1, got 0"
    assert "not valid JSON" in items[3].error
    assert "unknown keys ['max_tokns']" in items[4].error
    assert "'prompt' must be a string" in items[5].error
    assert items[6].params.n == 2 and items[6].priority == 2



def _prompt_items(tmp_path, lines: list, **kw) -> list:
    """The items of a prompt file of `lines`: dicts are written as JSON, str and bytes as they are."""
    path = tmp_path / "prompts.jsonl"
    raw = [json.dumps(x).encode() if isinstance(x, dict) else x if isinstance(x, bytes) else x.encode()
           for x in lines]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return load_workload(_cfg(kind="prompts", path=str(path), **kw), CharTokenizer())


def test_prompt_file_accepts_every_sampling_params_field(tmp_path):
    lines = [
        {"prompt": "a", "stop": ["\n\n", "END"], "stop_token_ids": [2], "include_stop_str_in_output": True,
         "logprobs": 5, "prompt_logprobs": 0, "min_tokens": 2, "max_tokens": 8, "repetition_penalty": 1.2,
         "presence_penalty": -0.5, "frequency_penalty": 1, "min_p": 0.05, "top_k": -1, "top_p": 0.9,
         "temperature": 0.7, "seed": 7, "skip_special_tokens": False, "ignore_eos": True},
        {"prompt": "b", "use_beam_search": True, "n": 3, "temperature": 0, "length_penalty": 0.5,
         "early_stopping": "never"},
        {"prompt": "c", "n": 2, "best_of": 4, "stop": "x"},
        {"prompt": "d"},
    ]
    a, b, c, d = _prompt_items(tmp_path, lines)
    assert [it.error for it in (a, b, c, d)] == [None] * 4
    assert a.params.stop_strings == ("\n\n", "END") and a.params.stop_token_ids == [2]
    assert (a.params.logprobs, a.params.prompt_logprobs, a.params.min_tokens) == (5, 0, 2)
    assert (a.params.repetition_penalty, a.params.presence_penalty, a.params.min_p) == (1.2, -0.5, 0.05)
    assert a.params.top_k == 0 and a.params.seed == 7 and not a.params.skip_special_tokens
    assert a.params.include_stop_str_in_output and a.params.ignore_eos
    assert b.params.use_beam_search and b.params.beam_width == 3 and b.params.early_stopping == "never"
    assert b.params.length_penalty == 0.5
    assert (c.params.n, c.params.best_of, c.params.stop_strings) == (2, 4, ("x",))
    # a line without temperature samples at the workload's default (0.0, greedy), not SamplingParams' 1.0
    assert d.params.greedy and d.params.n == 1 and d.params.max_tokens == 16


def test_prompt_file_bad_values_name_the_field_and_the_line(tmp_path):
    lines = [
        {"prompt": "ok"},
        {"prompt": "x", "logprobs": 21},
        {"prompt": "x", "repetition_penalty": 0},
        {"prompt": "x", "use_beam_search": True, "n": 1, "temperature": 0},
        {"prompt": "x", "use_beam_search": True, "n": 2, "temperature": 0.8},
        {"prompt": "x", "ignore_eos": "false"},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "stop": 5},
        {"prompt": "x", "stop_token_ids": [1, "2"]},
        {"prompt": "x", "min_tokens": 9, "max_tokens": 4},
        {"prompt": "x", "stop_strings": ["a"]},
        {"prompt": "x", "priority": "2"},
        {"prompt": "x", "priority": 1.5},
        {"prompt": "last", "priority": -1},
    ]
    items = _prompt_items(tmp_path, lines)
    errors = [it.error for it in items]
    assert errors[0] is None and items[0].params is not None
    assert errors[1] == "line 2: logprobs must be an integer in [0, 20] or None, got 21"
    assert errors[2].startswith("line 3: repetition_penalty must be > 0")
    assert errors[3].startswith("line 4: beam search needs a beam width (n, or best_of) > 1, got n=1")
    assert errors[4] == "line 5: temperature must be 0 with beam search, got 0.8"
    assert errors[5] == "line 6: ignore_eos must be bool, got 'false'"
    assert errors[6] == "line 7: temperature must be float, got 'hot'"
    assert errors[7] == "line 8: stop must be str | list[str] | None, got 5"
    assert errors[8] == "line 9: stop_token_ids must be list[int] | None, got [1, '2']"
    assert errors[9] == "line 10: min_tokens must be <= max_tokens=4, got 9"
    # a derived field is no input
    assert errors[10].startswith("line 11: unknown keys ['stop_strings']; allowed: prompt, n, best_of,")
    assert "skip_special_tokens, priority" in errors[10]
    assert errors[11] == "line 12: priority must be an integer, got '2'"
    assert errors[12] == "line 13: priority must be an integer, got 1.5"
    assert errors[13] is None and items[13].priority == -1
    assert all(it.params is None for it in items[1:13])


def test_prompt_file_line_that_is_not_utf8_is_an_error_and_the_rest_runs(tmp_path):
    lines = [{"prompt": "first"}, "", b'{"prompt": "caf\xe9 bad \xff"}', {"prompt": "na\u00efve \u2028 ok"}]
    items = _prompt_items(tmp_path, lines)
    assert len(items) == 3  # the blank line 2 counts for the numbering but is no request
    assert items[0].error is None and items[0].prompt == "first"
    assert items[1].error == "line 3 is not valid UTF-8 (byte 0xe9 at column 16)"
    assert items[1].params is None and items[1].request_id == "req-1"
    # U+2028 inside a JSON string is no line break (str.splitlines would have cut the line there)
    assert items[2].error is None and items[2].prompt == "na\u00efve \u2028 ok" and items[2].request_id == "req-2"


def test_prompt_file_with_a_byte_order_mark_parses_line_one(tmp_path):
    items = _prompt_items(tmp_path, [b"\xef\xbb\xbf" + json.dumps({"prompt": "hi", "n": 2}).encode(),
                                     "\ufeff{}"])
    assert items[0].error is None and items[0].prompt == "hi" and items[0].params.n == 2
    # only the file's first bytes are a byte order mark; later, one is an error as any stray character
    assert items[1].error == "line 2 is not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)"


@pytest.mark.parametrize("kind", ["synthetic", "fixed", "trace"])
def test_workload_sampling_keys_reach_every_generated_request(kind):
    cfg = _cfg(kind=kind, num_requests=5, path="azure_code_2023.csv", n=4, use_beam_search=True,
               length_penalty=0.5, prompt_len=20, output_len=5)
    items = load_workload(cfg, None, vocab_size=100)
    assert len(items) == 5
    for it in items:
        p = it.params
        assert (p.n, p.best_of, p.use_beam_search, p.length_penalty, p.greedy, p.ignore_eos) == (
            4, 4, True, 0.5, True, True)
    sampled = load_workload(_cfg(num_requests=3, n=2, best_of=3, temperature=0.8), None, vocab_size=100)
    assert all((it.params.n, it.params.best_of, it.params.temperature) == (2, 3, 0.8) for it in sampled)


def test_workload_sampling_keys_are_prompt_line_defaults(tmp_path):
    lines = [{"prompt": "a"}, {"prompt": "b", "n": 2}, {"prompt": "c", "use_beam_search": False}]
    a, b, c = _prompt_items(tmp_path, lines, n=3, use_beam_search=True)
    assert a.params.use_beam_search and a.params.n == 3
    assert b.params.use_beam_search and b.params.n == 2
    assert not c.params.use_beam_search and c.params.n == 3


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"use_beam_search": True}, "workload.n=1 workload.best_of=null workload.use_beam_search=true"),
        ({"n": 0}, r"workload.n=0 .*: n must be an integer >= 1, got 0"),
        ({"n": 4, "best_of": 2}, r"workload.best_of=2 .*: best_of must be >= n, got n=4 and best_of=2"),
        ({"n": 2, "use_beam_search": True, "temperature": 0.7},
         r"workload.temperature=0.7 .*: temperature must be 0 with beam search"),
        ({"length_penalty": 2.0}, r"workload.length_penalty=2.0 .*: length_penalty only applies to beam search"),
    ],
)
@pytest.mark.parametrize("kind", ["synthetic", "prompts"])
def test_bad_workload_sampling_keys_fail_before_the_run_naming_the_key(tmp_path, kind, kw, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=message):
        load_workload(_cfg(kind=kind, path=str(path), **kw), CharTokenizer())


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
