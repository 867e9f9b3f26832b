"""`from paged import LLM, SamplingParams`: vLLM's offline API, on the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged import LLM, SamplingParams
from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.experiment.run import run_experiment

PROMPTS = ["The capital of France is", "Hello", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random")


def test_generate_on_strings_returns_decoded_outputs_of_max_tokens(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))
    assert len(outs) == len(PROMPTS)
    tokenizer = llm.executor.tokenizer
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tokenizer.encode(prompt)
        (completion,) = out.outputs
        assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert (out.text, out.token_ids) == (completion.text, completion.token_ids)
        assert out.abort_reason is None


def test_generate_on_token_ids_equals_generate_on_the_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    ids = [llm.executor.tokenizer.encode(p) for p in PROMPTS]
    from_ids = llm.generate(ids, params)
    assert [o.prompt for o in from_ids] == [None] * len(PROMPTS)
    assert [o.prompt_token_ids for o in from_ids] == ids
    assert [o.token_ids for o in from_ids] == [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_per_prompt_params_are_honoured(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (1, 7, 3)]
    assert [len(o.token_ids) for o in llm.generate(PROMPTS, params)] == [1, 7, 3]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS, params[:2])


def test_n_2_gives_two_distinct_sampled_outputs(llm: LLM) -> None:
    (out,) = llm.generate("Hello", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1]
    assert [len(c.token_ids) for c in out.outputs] == [6, 6]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


def test_seeded_request_is_reproducible_across_instances_and_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    other = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    batched = llm.generate(PROMPTS, [other, seeded, other])[1].token_ids
    alone = LLM("tiny-random").generate(PROMPTS[1], seeded)[0].token_ids
    assert alone == batched
    reseeded = SamplingParams(temperature=1.0, seed=4321, max_tokens=8, ignore_eos=True)
    assert llm.generate(PROMPTS[1], reseeded)[0].token_ids != batched


def test_eos_stops_generation_unless_ignore_eos(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))[0].token_ids
    k = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])
    executor = build_executor(llm.config)
    executor.eos_token_ids = frozenset([greedy[k]])  # make a token the model is about to emit its EOS
    eos_llm = LLM("tiny-random", executor=executor)

    (stopped,) = eos_llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0)).pop().outputs
    assert (stopped.token_ids, stopped.finish_reason) == (greedy[: k + 1], "stop")
    ignoring = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    (ignored,) = eos_llm.generate(PROMPTS[0], ignoring).pop().outputs
    assert (ignored.token_ids, ignored.finish_reason) == (greedy, "length")
    stopping = SamplingParams(max_tokens=8, stop_token_ids=[greedy[k]], temperature=0.0)
    (stop_token,) = llm.generate(PROMPTS[0], stopping).pop().outputs
    assert (stop_token.token_ids, stop_token.finish_reason) == (greedy[: k + 1], "stop")


def test_request_that_cannot_run_is_aborted_with_reason_and_others_finish(llm: LLM) -> None:
    # a well-formed prompt that the configuration cannot serve is aborted (bad input fails the call:
    # tests/test_llm_inputs.py)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (5000, 3)]
    too_long, good = llm.generate(["Hi", "Hello"], params)
    assert too_long.abort_reason.startswith("prompt (1 tokens) + max_tokens (5000) = 5001 tokens")
    assert [c.finish_reason for c in too_long.outputs] == ["aborted"] and too_long.token_ids == []
    assert good.abort_reason is None and len(good.token_ids) == 3


def test_llm_runs_the_same_engine_as_run_py(llm: LLM, tmp_path: Path) -> None:
    records = [
        {"prompt": PROMPTS[0], "max_tokens": 5, "ignore_eos": True},
        {"prompt": PROMPTS[1], "max_tokens": 7, "temperature": 0.8, "seed": 11, "ignore_eos": True},
        {"prompt": PROMPTS[2], "max_tokens": 3, "ignore_eos": True},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = compose_config(["model=tiny-random", "logger=none", "progress=false", "workload=prompts",
                          f"workload.path={path}"])
    run_experiment(cfg, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]

    # a prompt line without a temperature takes workload.temperature (greedy), not vLLM's 1.0
    params = [SamplingParams(**{"temperature": 0.0} | {k: v for k, v in r.items() if k != "prompt"}) for r in records]
    outs = llm.generate([r["prompt"] for r in records], params)
    assert [line["output_token_ids"] for line in lines] == [o.token_ids for o in outs]
    assert [line["output_text"] for line in lines] == [o.text for o in outs]


def test_priority_and_client_id_reach_the_policy() -> None:
    llm = LLM("tiny-random", scheduler="priority", overrides=["scheduler.max_num_seqs=1"])
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    outs = llm.generate(PROMPTS, params, priority=[2, 0, 1], client_id=["a", "b", None])
    # one seat: the requests run one after another, most important (lowest value) first
    assert sorted(range(3), key=lambda i: outs[i].metrics.first_token_time) == [1, 2, 0]
    assert [r.client_id for r in llm.engine.metrics.requests] == ["a", "b", None]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"priority": [0, 1.5, 2]}, "priority must be an integer (lower is served first), got 1.5"),
        ({"priority": [0, True, 2]}, "priority must be an integer"),
        ({"priority": [0]}, "got 1 priority values for 3 prompts"),
        ({"client_id": ["a", 7, None]}, "client_id must be a string or None, got 7"),
    ],
)
def test_bad_priority_or_client_is_refused_before_anything_runs(llm: LLM, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), **kwargs)
    assert not llm.engine.has_unfinished
