from __future__ import annotations

import numpy as np
import torch

from paged.model.sampler import SampleRow, sample, sample_probs
from paged.request import SamplingParams

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
