from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from paged.engine.runner import drive
from paged.model.sampler import SampleRow, apply_penalties, sample, sample_probs, top_logprobs
from paged.request import Request, SamplingParams
from paged.step import Samples

GREEDY = SamplingParams(temperature=0)


def draw(x: torch.Tensor, rows: list[SampleRow]) -> list[list[int]]:
    return [s.token_ids for s in sample(x, rows)]


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def rows_of(params: SamplingParams, n: int, seed: int = 7, step: int = 0) -> list[SampleRow]:
    return [SampleRow(params, seed=seed, seq_index=i, num_output_tokens=step) for i in range(n)]


def test_greedy_is_argmax() -> None:
    x = logits()
    assert draw(x, rows_of(SamplingParams(temperature=0), 4)) == [[t] for t in x.argmax(-1).tolist()]


def test_seeded_sampling_is_reproducible_and_depends_on_the_step() -> None:
    x = logits(rows=1, vocab=1000)
    params = SamplingParams(temperature=5.0)
    draws = [draw(x, rows_of(params, 1, step=s))[0][0] for s in range(20)]
    assert draws == [draw(x, rows_of(params, 1, step=s))[0][0] for s in range(20)]
    assert len(set(draws)) > 1


def test_a_draw_does_not_depend_on_its_batch_neighbours() -> None:
    x = logits(rows=3, vocab=5000) / 3
    params = SamplingParams(temperature=1.0)
    alone = [draw(x[1:2], [SampleRow(params, seed=99, num_output_tokens=s)])[0] for s in range(30)]
    filtering = SampleRow(SamplingParams(temperature=1.0, top_k=5), 1)
    batched = [
        draw(x, [SampleRow(GREEDY, 0), SampleRow(params, seed=99, num_output_tokens=s), filtering])[1]
        for s in range(30)
    ]
    assert batched == alone


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    x = logits(rows=6, vocab=500)
    greedy = draw(x, rows_of(SamplingParams(temperature=0), 6))
    assert draw(x, rows_of(SamplingParams(temperature=2.0, top_k=1), 6)) == greedy
    assert draw(x, rows_of(SamplingParams(temperature=2.0, top_p=1e-6), 6)) == greedy


def test_top_k_and_top_p_keep_the_right_support() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_p = sample_probs(x, [SamplingParams(temperature=1.0, top_p=0.8)])
    assert (top_p[0] > 0).tolist() == [True, True, False, False]
    top_k = sample_probs(x, [SamplingParams(temperature=1.0, top_k=3)])
    assert (top_k[0] > 0).tolist() == [True, True, True, False]
    # top-p applies to the top-k survivors, renormalised: 0.5 / 0.8 already reaches 0.6.
    both = sample_probs(x, [SamplingParams(temperature=1.0, top_k=2, top_p=0.6)])
    assert (both[0] > 0).tolist() == [True, False, False, False]


def test_sampled_frequencies_follow_the_softmax() -> None:
    x = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    params = SamplingParams(temperature=1.0)
    counts = np.bincount(
        [draw(x, [SampleRow(params, seed=5, num_output_tokens=s)])[0][0] for s in range(4000)], minlength=4
    )
    expected = torch.softmax(x[0], -1).numpy()
    assert np.abs(counts / 4000 - expected).max() < 0.03


def test_temperature_sharpens_and_flattens() -> None:
    x = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    cold = sample_probs(x, [SamplingParams(temperature=0.25)])[0]
    hot = sample_probs(x, [SamplingParams(temperature=4.0)])[0]
    assert cold.max() > 0.95 and hot.max() < 0.4


def test_num_samples_draws_independent_tokens_for_each_child_index() -> None:
    x = logits(rows=1, vocab=1000) / 10
    params = SamplingParams(temperature=1.0, n=4)
    first = draw(x, [SampleRow(params, seed=3, num_samples=4)])[0]
    assert len(first) == 4 and len(set(first)) > 1
    # Child j draws later tokens as sequence index j: its first token came from the same key.
    assert [draw(x, [SampleRow(params, seed=3, seq_index=j)])[0][0] for j in range(4)] == first
    assert draw(x, [SampleRow(SamplingParams(n=3, temperature=0), seed=0, num_samples=3)])[0] == [int(x.argmax())] * 3


# -- host syncs: one device-to-host read per step (issue 27) ------------------------------------------

# Tensor functions that hand a value to the host: on a GPU each one waits for the device. `unique`,
# `bincount`, `nonzero` and `masked_select` read a size back to shape their output.
HOST_READS = frozenset(
    {"item", "tolist", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy",
     "unique", "bincount", "nonzero", "masked_select"}
)


class HostReads(TorchFunctionMode):
    """Records every tensor function in `HOST_READS` called while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def counted_sample(x: torch.Tensor, rows: list[SampleRow]) -> tuple[list[Samples], list[str]]:
    with HostReads() as mode:
        out = sample(x, rows, eos_token_ids=(0,))
    return out, mode.reads


def seen(step: int, seed: int = 0) -> dict:
    """A sequence's tokens after `step` outputs, so the penalties and min_tokens have something to count."""
    tokens = torch.randint(50, (4 + step,), generator=torch.Generator().manual_seed(seed)).tolist()
    return {"token_ids": tokens, "num_prompt_tokens": 4, "num_output_tokens": step}


PENALTIES = SamplingParams(
    temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.4, seed=1
)
MIN_TOKENS = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[3, 5])
NO_LOGPROB_BATCHES = {
    "greedy": [SampleRow(GREEDY, 0), SampleRow(GREEDY, 0, num_samples=3)],
    "random": [SampleRow(SamplingParams(temperature=t), i) for i, t in enumerate((0.5, 1.0, 2.0))],
    "filtered": [
        SampleRow(SamplingParams(temperature=1.0, top_k=5), 1),
        SampleRow(SamplingParams(temperature=1.0, top_p=0.8), 2, num_samples=2),
        SampleRow(SamplingParams(temperature=1.0, min_p=0.1), 3),
    ],
    "penalties": [
        SampleRow(PENALTIES, 4, **seen(3)),
        SampleRow(SamplingParams(temperature=0, repetition_penalty=0.8), 0, **seen(0)),
    ],
    "min_tokens": [SampleRow(MIN_TOKENS, 0, **seen(2)), SampleRow(MIN_TOKENS, 0, **seen(5))],
    "mixed": [
        SampleRow(GREEDY, 0),
        SampleRow(SamplingParams(n=3, temperature=0.9, top_k=10, seed=2), 2, num_samples=3),
        SampleRow(PENALTIES, 4, **seen(6, seed=1)),
        SampleRow(MIN_TOKENS, 0, **seen(1, seed=2)),
        SampleRow(SamplingParams(n=2, temperature=1.0, top_p=0.9, min_p=0.05), 5, seq_index=1),
    ],
}


@pytest.mark.parametrize("batch", NO_LOGPROB_BATCHES)
def test_host_sync_one_read_per_step_without_logprobs(batch: str) -> None:
    rows = NO_LOGPROB_BATCHES[batch]
    x = logits(rows=len(rows))
    out, reads = counted_sample(x, rows)
    assert reads == ["tolist"]
    assert [len(s.token_ids) for s in out] == [r.num_samples for r in rows]
    # no log-probabilities computed: placeholders of the tokens' length, which consumers zip with them
    assert all(s.logprobs == [0.0] * len(s.token_ids) and s.top_logprobs is None for s in out)
    # the tokens do not depend on whether a row's log-probabilities are computed
    asking = [dataclasses.replace(r, params=dataclasses.replace(r.params, logprobs=2)) for r in rows]
    assert [s.token_ids for s in sample(x, asking, eos_token_ids=(0,))] == [s.token_ids for s in out]


def test_host_sync_one_read_with_logprobs_and_unchanged_values() -> None:
    rows = [
        SampleRow(GREEDY, 0),  # asks for nothing
        SampleRow(SamplingParams(temperature=0, logprobs=0), 0),
        SampleRow(SamplingParams(n=2, temperature=0.8, seed=3, logprobs=3), 3, num_samples=2),
        SampleRow(SamplingParams(temperature=1.0, top_k=4, logprobs=3, repetition_penalty=1.5), 1, **seen(2)),
        SampleRow(SamplingParams(n=2, best_of=3, temperature=1.0, seed=9), 9, num_samples=3),  # ranked by them
        SampleRow(SamplingParams(n=3, use_beam_search=True, temperature=0), 0, num_samples=6),
        SampleRow(SamplingParams(n=2, use_beam_search=True, temperature=0, logprobs=1, presence_penalty=1.0), 0,
                  **seen(3)),
    ]
    x = logits(rows=len(rows), vocab=300)
    out, reads = counted_sample(x, rows)
    assert reads == ["tolist"]
    assert out[0].logprobs == [0.0] and out[0].top_logprobs is None
    processed = apply_penalties(x, rows, eos_token_ids=(0,))
    for i, (r, s) in enumerate(zip(rows, out, strict=True)):
        if i == 0:
            continue
        raw = torch.log_softmax(x[i], dim=-1)
        k = r.params.logprobs
        # the reference: what the sampler reported before it batched them, one row at a time
        assert s.top_logprobs == (top_logprobs(raw, s.token_ids, k) if k is not None else None)
        if r.params.use_beam_search:  # candidates carry the penalised scores they were ranked by
            expected = torch.log_softmax(processed[i], dim=-1)[s.token_ids].tolist()
        else:
            expected = raw[s.token_ids].tolist()
        if k is not None and not r.params.use_beam_search:
            assert s.logprobs == expected  # the very values its entries show
        else:  # logits - logsumexp: the same log-probability, rounded apart from log_softmax's last bit
            assert s.logprobs == pytest.approx(expected, rel=1e-6)


def test_cumulative_logprob_is_none_unless_the_sampler_computed_logprobs() -> None:
    from paged import LLM
    from paged.api.outputs import request_record
    from paged.engine.metrics import RequestMetrics

    llm = LLM("tiny-random")
    plain, asking, ranked = llm.generate(
        [[1, 2, 3]] * 3,
        [
            SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True, logprobs=0),
            SamplingParams(n=1, best_of=2, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    # vLLM V1: None where the request asked for no log-probabilities
    assert [c.cumulative_logprob for c in plain.outputs] == [None, None]
    assert plain.outputs[0].token_ids == asking.outputs[0].token_ids
    (c,) = asking.outputs
    assert c.logprobs is not None and c.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)), abs=1e-5
    )
    # best_of > n ranks by cumulative log-probability, so it has (and reports) one
    assert ranked.outputs[0].cumulative_logprob is not None and ranked.outputs[0].cumulative_logprob < 0
    # requests.jsonl likewise
    records = []
    for i, logprobs in enumerate((None, 0)):
        request = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0, logprobs=logprobs))
        llm.engine.add_request(request)
        drive(llm.engine)
        records.append(request_record(request, RequestMetrics.of(request), None)["outputs"][0])
    assert records[0]["cumulative_logprob"] is None and isinstance(records[1]["cumulative_logprob"], float)
