"""What the scheduler's policies read off a workload: the client of each request (fair sharing), its
priority (priority preemption), and which of several shared prefixes it opens with (longest-prefix
match); each drawn from its own stream, so the rest of the workload does not move."""

import json
from importlib import resources

import numpy as np
import pytest

from paged.config import ConfigError, WorkloadConfig, compose_config, validate
from paged.engine.runner import to_request
from paged.request import SamplingParams
from paged.workload import WorkloadItem, load_workload


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _cfg(**kw) -> WorkloadConfig:
    base = {"name": "t", "kind": "synthetic", "num_requests": 200, "length_scale": 0.2, "prompt_len_min": 1,
            "output_len_min": 1, "arrival_rate": 5.0, "path": "azure_code_2023.csv", "prompt_len": 40,
            "output_len": 8}
    return WorkloadConfig(**{**base, **kw})


def _shape(items: list[WorkloadItem], prefix_len: int = 0) -> list[tuple]:
    """Per request everything but the draws: body ids (after the prefix), output length, arrival."""
    return [(it.prompt_token_ids[prefix_len:], it.params.max_tokens, it.arrival_time) for it in items]


def test_clients_follow_the_weights_and_are_seeded():
    items = load_workload(_cfg(num_requests=1000, num_clients=2, client_weights=[4.0, 1.0]), None, vocab_size=100)
    clients = [it.client_id for it in items]
    assert set(clients) == {"client-0", "client-1"}
    assert abs(clients.count("client-0") / 1000 - 0.8) < 0.04
    again = load_workload(_cfg(num_requests=1000, num_clients=2, client_weights=[4.0, 1.0]), None, vocab_size=100)
    assert [it.client_id for it in again] == clients
    other_seed = load_workload(_cfg(num_requests=1000, num_clients=2, client_weights=[4.0, 1.0], seed=1), None,
                               vocab_size=100)
    assert [it.client_id for it in other_seed] != clients
    equal = [it.client_id for it in load_workload(_cfg(num_requests=900, num_clients=3), None, vocab_size=100)]
    assert all(abs(equal.count(f"client-{k}") / 900 - 1 / 3) < 0.05 for k in range(3))
    # a zero weight is a client that never sends
    assert "client-1" not in {it.client_id for it in load_workload(
        _cfg(num_clients=3, client_weights=[1.0, 0.0, 1.0]), None, vocab_size=100)}


def test_no_clients_and_no_priorities_by_default():
    items = load_workload(_cfg(), CharTokenizer())
    assert all(it.client_id is None and it.priority == 0 for it in items)


def test_priorities_are_uniform_in_range_and_independent_of_clients():
    items = load_workload(_cfg(num_requests=600, num_priorities=3), None, vocab_size=100)
    priorities = [it.priority for it in items]
    assert set(priorities) == {0, 1, 2}
    assert all(abs(priorities.count(p) / 600 - 1 / 3) < 0.06 for p in range(3))
    with_clients = load_workload(_cfg(num_requests=600, num_priorities=3, num_clients=4), None, vocab_size=100)
    assert [it.priority for it in with_clients] == priorities


@pytest.mark.parametrize("kind", ["synthetic", "fixed", "trace"])
@pytest.mark.parametrize("tokenizer", [CharTokenizer(), None], ids=["tokenizer", "spec-only"])
def test_the_draws_leave_lengths_arrivals_and_ids_unchanged(kind, tokenizer):
    plain = load_workload(_cfg(kind=kind, shared_prefix_len=8), tokenizer, vocab_size=100, max_model_len=128)
    drawn = load_workload(_cfg(kind=kind, shared_prefix_len=8, num_clients=3, client_weights=[1.0, 2.0, 3.0],
                               num_priorities=4, num_prefixes=5), tokenizer, vocab_size=100, max_model_len=128)
    assert _shape(drawn, 8) == _shape(plain, 8)
    assert [len(it.prompt_token_ids) for it in drawn] == [len(it.prompt_token_ids) for it in plain]


@pytest.mark.parametrize("kind", ["synthetic", "fixed"])
@pytest.mark.parametrize("tokenizer", [CharTokenizer(), None], ids=["tokenizer", "spec-only"])
def test_several_prefixes_are_distinct_and_shuffled(kind, tokenizer):
    items = load_workload(_cfg(kind=kind, shared_prefix_len=20, num_prefixes=4), tokenizer, vocab_size=100)
    heads = [tuple(it.prompt_token_ids[:20]) for it in items]
    prefixes = sorted(set(heads))
    assert len(prefixes) == 4
    order = [prefixes.index(h) for h in heads]
    # interleaved in arrival order, not one prefix's requests after another's
    assert sum(a != b for a, b in zip(order, order[1:])) > len(order) / 2
    assert all(abs(order.count(k) / len(order) - 1 / 4) < 0.1 for k in range(4))
    if kind == "fixed":
        assert all(len(it.prompt_token_ids) == 40 for it in items)  # the prefix is part of prompt_len
    # prefix choice is seeded: a second load is the same workload
    again = load_workload(_cfg(kind=kind, shared_prefix_len=20, num_prefixes=4), tokenizer, vocab_size=100)
    assert [it.prompt_token_ids for it in again] == [it.prompt_token_ids for it in items]


def test_one_prefix_is_the_single_shared_prefix_of_before():
    corpus = CharTokenizer().encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    items = load_workload(_cfg(shared_prefix_len=24), CharTokenizer())
    assert all(list(it.prompt_token_ids[:24]) == corpus[:24] for it in items)
    # spec-only: the prefix stream's first ids, as a single prefix was drawn before num_prefixes
    expected = np.random.default_rng([0, 1]).integers(100, size=24).tolist()
    items = load_workload(_cfg(shared_prefix_len=24), None, vocab_size=100)
    assert all(list(it.prompt_token_ids[:24]) == expected for it in items)
    # and it stays the first of several
    several = load_workload(_cfg(shared_prefix_len=24, num_prefixes=3), None, vocab_size=100)
    assert expected in [list(it.prompt_token_ids[:24]) for it in several]


def test_prefixes_that_cannot_be_distinct_fail_naming_the_keys():
    with pytest.raises(ValueError, match=r"workload.num_prefixes=5: only 2 distinct prefixes of "
                                         r"workload.shared_prefix_len=1 tokens"):
        load_workload(_cfg(shared_prefix_len=1, num_prefixes=5), None, vocab_size=2)


def _prompt_items(tmp_path, lines: list, **kw) -> list[WorkloadItem]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return load_workload(_cfg(kind="prompts", path=str(path), **kw), CharTokenizer())


def test_prompt_file_client_key_and_bad_clients_abort_only_their_line(tmp_path):
    lines = [{"prompt": "a", "client": "alice"}, {"prompt": "b"}, {"prompt": "c", "client": 5},
             {"prompt": "d", "client": None}, {"prompt": "e", "client": "bob", "priority": 2}]
    a, b, c, d, e = _prompt_items(tmp_path, lines)
    assert (a.error, a.client_id) == (None, "alice")
    assert (b.error, b.client_id) == (None, None)  # no clients in the workload, none on the line
    assert c.error == "line 3: client must be a string, got 5" and c.params is None
    assert d.error == "line 4: client must be a string, got None" and d.params is None
    assert (e.error, e.client_id, e.priority) == (None, "bob", 2)


def test_prompt_file_lines_default_to_the_workload_draws(tmp_path):
    lines = [{"prompt": f"p{i}"} for i in range(40)] + ["{bad", {"prompt": "x", "client": "me", "priority": 9}]
    items = _prompt_items(tmp_path, lines, num_clients=2, num_priorities=3)
    drawn = items[:40]
    assert {it.client_id for it in drawn} == {"client-0", "client-1"}
    assert {it.priority for it in drawn} == {0, 1, 2}
    assert items[40].error.startswith("line 41 is not valid JSON") and items[40].client_id in {"client-0", "client-1"}
    assert (items[41].client_id, items[41].priority) == ("me", 9)
    assert [it.client_id for it in _prompt_items(tmp_path, lines, num_clients=2, num_priorities=3)] == [
        it.client_id for it in items]


def test_runner_passes_client_and_priority_to_the_request():
    request = to_request(WorkloadItem("r", [1, 2], SamplingParams(max_tokens=2), priority=3, client_id="client-1"))
    assert (request.client_id, request.priority) == ("client-1", 3)
    assert to_request(WorkloadItem("r", [1], None)).client_id is None


def test_the_keys_compose_from_overrides():
    cfg = compose_config(["workload.num_clients=2", "workload.client_weights=[4,1]", "workload.num_priorities=2",
                          "workload.shared_prefix_len=16", "workload.num_prefixes=3"])
    validate(cfg)
    items = load_workload(cfg.workload, None, vocab_size=1000)
    assert {it.client_id for it in items} == {"client-0", "client-1"}
    assert {it.priority for it in items} <= {0, 1}
    assert len({tuple(it.prompt_token_ids[:16]) for it in items}) == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.num_clients=-1"], r"workload.num_clients=-1 must be >= 0"),
        (["workload.client_weights=[1,1]"], r"workload.client_weights=\[1.0, 1.0\] needs workload.num_clients > 0"),
        (["workload.num_clients=3", "workload.client_weights=[4,1]"],
         r"workload.client_weights=\[4.0, 1.0\] must have one weight per client: 3 \(workload.num_clients\), got 2"),
        (["workload.num_clients=2", "workload.client_weights=[1,-1]"],
         r"workload.client_weights=\[1.0, -1.0\] must all be >= 0 with a sum > 0"),
        (["workload.num_clients=2", "workload.client_weights=[0,0]"],
         r"workload.client_weights=\[0.0, 0.0\] must all be >= 0 with a sum > 0"),
        (["workload.num_priorities=-2"], r"workload.num_priorities=-2 must be >= 0"),
        (["workload.num_prefixes=0"], r"workload.num_prefixes=0 must be >= 1"),
        (["workload.num_prefixes=4"], r"workload.num_prefixes=4 needs workload.shared_prefix_len > 0, got 0"),
    ],
)
def test_bad_draw_keys_raise_config_error_naming_key_and_value(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))
