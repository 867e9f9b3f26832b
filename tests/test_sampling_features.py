"""vLLM's sampling features end to end: SamplingParams checks, penalties / min_p / min_tokens in the
sampler against hand-computed logits, stop strings and stop tokens, log-probabilities against
transformers, seeded parallel sampling and best_of, and the RequestOutput record.

Cheap checks run on the tiny random model (one LLM for the module); the stop-string and logprob
checks run on the real SmolLM2-135M (loaded once; skipped when its package is missing), with a
transformers `LlamaForCausalLM` built from the same GGUF as the reference.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from paged import LLM, SamplingParams
from paged.config import KernelConfig, ModelConfig
from paged.engine.runner import drive
from paged.model.sampler import SampleRow, apply_penalties, sample, sample_probs
from paged.request import MAX_LOGPROBS, Request
from tests.hf_reference import smollm2_reference

# ---------------------------------------------------------------------------------------------
# 1. Bad input
# ---------------------------------------------------------------------------------------------

BAD_PARAMS = [
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 2, "use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"n": 1, "use_beam_search": True, "temperature": 0.0}, "beam width"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logprobs": MAX_LOGPROBS + 1}, "^logprobs"),
    ({"logprobs": -1}, "^logprobs"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "^prompt_logprobs"),
    ({"prompt_logprobs": -1}, "^prompt_logprobs"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_PARAMS, ids=[f"{k}-{f}" for k, f in BAD_PARAMS])
def test_bad_sampling_params_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_beam_search_n1_names_n_and_boundary_values_are_accepted() -> None:
    with pytest.raises(ValueError, match=r"\bn=1\b"):
        SamplingParams(n=1, use_beam_search=True, temperature=0.0)
    # the edges of every range are legal
    SamplingParams(top_p=1.0, min_p=0.0)
    SamplingParams(top_p=1e-6, min_p=1.0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3)
    SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS)
    SamplingParams(logprobs=0, prompt_logprobs=0)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(stop="x", n=2, best_of=2)
    SamplingParams(n=2, use_beam_search=True, temperature=0.0, length_penalty=0.5, early_stopping=True)


# ---------------------------------------------------------------------------------------------
# tiny random model: one LLM for the module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny-random")


PROMPT = "Hello"


def test_request_over_max_model_len_is_aborted_with_the_numbers_and_others_complete(tiny: LLM) -> None:
    llm = LLM("tiny-random", overrides=["scheduler.max_model_len=32"], executor=tiny.executor)
    prompt = list(range(100, 111))  # 11 tokens
    too_long, fits, short = llm.generate(
        [prompt, prompt, [7, 8, 9]],
        [SamplingParams(max_tokens=25, ignore_eos=True, temperature=0.0),  # 11 + 25 = 36 > 32
         SamplingParams(max_tokens=21, ignore_eos=True, temperature=0.0),  # 11 + 21 = 32: fits exactly
         SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)],
        use_tqdm=False,
    )
    assert too_long.abort_reason is not None
    assert {11, 25, 36, 32} <= {int(n) for n in re.findall(r"\d+", too_long.abort_reason)}
    assert [c.finish_reason for c in too_long.outputs] == ["aborted"] and too_long.token_ids == []
    assert fits.abort_reason is None and len(fits.token_ids) == 21 and fits.outputs[0].finish_reason == "length"
    assert short.abort_reason is None and len(short.token_ids) == 5 and short.outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# 2. Penalties, min_p and min_tokens in the sampler
# ---------------------------------------------------------------------------------------------

X = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.2, 1.5])
PROMPT_IDS = [3, 5]
OUTPUT_IDS = [0, 2, 2, 1]  # counts: 0 -> 1, 1 -> 1, 2 -> 2; 3 and 5 only in the prompt


def penalised(**kw) -> tuple[torch.Tensor, int]:
    """The processed row and the greedy pick for penalties `kw` over PROMPT_IDS + OUTPUT_IDS."""
    params = SamplingParams(temperature=0.0, **kw)
    row = SampleRow(params, seed=0, num_output_tokens=len(OUTPUT_IDS), token_ids=PROMPT_IDS + OUTPUT_IDS,
                    num_prompt_tokens=len(PROMPT_IDS))
    x = X.clone()[None]
    out = apply_penalties(x, [row])
    assert torch.equal(x[0], X)  # the caller's logits are left alone
    (drawn,) = sample(x, [row])
    return out[0], drawn.token_ids[0]


@pytest.mark.parametrize(
    ("kw", "expected", "pick"),
    [
        ({}, [2.0, -1.0, 0.5, -0.5, 1.2, 1.5], 0),
        # prompt and output tokens: positive logits divided, negative multiplied
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, -1.0, 1.2, 0.75], 4),
        # output tokens only, penalty x count
        ({"frequency_penalty": 0.6}, [1.4, -1.6, -0.7, -0.5, 1.2, 1.5], 5),
        # output tokens only, once per token present
        ({"presence_penalty": 0.6}, [1.4, -1.6, -0.1, -0.5, 1.2, 1.5], 5),
        # negative penalties reward: token 2 (twice in the output) overtakes token 0
        ({"frequency_penalty": -1.0}, [3.0, 0.0, 2.5, -0.5, 1.2, 1.5], 0),
        ({"frequency_penalty": -2.0}, [4.0, 1.0, 4.5, -0.5, 1.2, 1.5], 2),
        # vLLM's order: repetition first, then frequency, then presence
        ({"repetition_penalty": 2.0, "frequency_penalty": 0.6, "presence_penalty": 0.6},
         [-0.2, -3.2, -1.55, -1.0, 1.2, 0.75], 4),
    ],
    ids=["none", "repetition", "frequency", "presence", "frequency-neg", "frequency-neg-flip", "all"],
)
def test_penalties_match_hand_computed_logits_and_move_the_greedy_pick(kw: dict, expected: list, pick: int) -> None:
    out, chosen = penalised(**kw)
    assert torch.allclose(out, torch.tensor(expected), atol=1e-6), out.tolist()
    assert chosen == pick


def test_penalties_touch_only_their_own_row() -> None:
    x = torch.stack([X, X])
    rows = [
        SampleRow(SamplingParams(temperature=0.0, presence_penalty=1.0), 0, num_output_tokens=4,
                  token_ids=PROMPT_IDS + OUTPUT_IDS, num_prompt_tokens=2),
        SampleRow(SamplingParams(temperature=0.0), 0, num_output_tokens=4,
                  token_ids=PROMPT_IDS + OUTPUT_IDS, num_prompt_tokens=2),
    ]
    out = apply_penalties(x, rows)
    assert torch.equal(out[1], X) and not torch.equal(out[0], X)
    # nothing to apply: the very same tensor comes back
    assert apply_penalties(x, rows[1:] * 2) is x


def test_min_p_zeroes_tokens_below_min_p_times_the_max_probability() -> None:
    p = torch.tensor([0.5, 0.2, 0.14, 0.1, 0.06])
    x = p.log()[None]
    probs = sample_probs(x, [SamplingParams(temperature=1.0, min_p=0.3)])[0]  # threshold 0.15
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs[:2] / probs[:2].sum(), p[:2] / p[:2].sum(), atol=1e-6)
    assert (sample_probs(x, [SamplingParams(temperature=1.0, min_p=0.0)])[0] > 0).all()
    # min_p acts on the tempered distribution: at T=2, p ~ sqrt(p), and 0.06 ** .5 > 0.3 * 0.5 ** .5
    assert (sample_probs(x, [SamplingParams(temperature=2.0, min_p=0.3)])[0] > 0).all()
    assert (sample_probs(x, [SamplingParams(temperature=2.0, min_p=0.36)])[0] > 0).tolist() == [True] * 4 + [False]
    # draws never land on a zeroed token, and do without min_p
    params, free = SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=1.0)
    drawn = {sample(x, [SampleRow(params, seed=1, num_output_tokens=s)])[0].token_ids[0] for s in range(300)}
    assert drawn == {0, 1}
    drawn_free = {sample(x, [SampleRow(free, seed=1, num_output_tokens=s)])[0].token_ids[0] for s in range(300)}
    assert drawn_free == {0, 1, 2, 3, 4}


EOS = 1
Y = torch.tensor([[0.0, 3.0, 1.0, 0.5, 2.0]])  # EOS the argmax, stop token 4 the runner-up


def min_tokens_row(num_output_tokens: int, **kw) -> SampleRow:
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, stop_token_ids=[4], **kw)
    return SampleRow(params, 0, num_output_tokens=num_output_tokens, token_ids=[3] * (2 + num_output_tokens),
                     num_prompt_tokens=2)


@pytest.mark.parametrize("done", [0, 2])
def test_min_tokens_bans_eos_and_stop_tokens_until_reached(done: int) -> None:
    row = min_tokens_row(done)
    out = apply_penalties(Y, [row], eos_token_ids={EOS})
    assert out[0, EOS] == -math.inf and out[0, 4] == -math.inf
    assert torch.equal(out[0, [0, 2, 3]], Y[0, [0, 2, 3]])
    # a row asking for log-probabilities (the sampler computes none for the others)
    (drawn,) = sample(Y, [min_tokens_row(done, logprobs=0)], eos_token_ids={EOS})
    assert drawn.token_ids == [2]
    # the reported log-probability is the model's raw one, not the banned distribution's
    assert drawn.logprobs[0] == pytest.approx(float(torch.log_softmax(Y[0], -1)[2]), abs=1e-6)


def test_min_tokens_lifts_the_ban_once_reached_and_ignore_eos_keeps_eos() -> None:
    row = min_tokens_row(3)
    assert apply_penalties(Y, [row], eos_token_ids={EOS}) is Y
    assert sample(Y, [row], eos_token_ids={EOS})[0].token_ids == [EOS]
    ignoring = min_tokens_row(0, ignore_eos=True)
    out = apply_penalties(Y, [ignoring], eos_token_ids={EOS})
    assert out[0, EOS] == 3.0 and out[0, 4] == -math.inf
    assert sample(Y, [ignoring], eos_token_ids={EOS})[0].token_ids == [EOS]


def test_min_tokens_end_to_end_keeps_generating_past_a_stop_token(tiny: LLM) -> None:
    (probe,) = tiny.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    first = probe.token_ids[0]
    (stopped,) = tiny.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first]), use_tqdm=False
    )
    assert stopped.token_ids == [first] and stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == first
    (held,) = tiny.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[first]), use_tqdm=False
    )
    assert len(held.token_ids) >= 4
    assert first not in held.token_ids[:4]
    assert held.token_ids[0] != first


def test_min_tokens_end_to_end_holds_off_eos_unless_ignore_eos(tiny: LLM) -> None:
    (probe,) = tiny.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    first = probe.token_ids[0]
    executor = tiny.executor
    saved = executor.eos_token_ids
    # the token the model is about to emit is its EOS (the scheduler stops at it, the sampler bans it)
    executor.eos_token_ids = frozenset([first])
    try:
        eos_llm = LLM("tiny-random", executor=executor)
        at_once, held = eos_llm.generate(
            [PROMPT, PROMPT],
            [SamplingParams(temperature=0.0, max_tokens=6),
             SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4)],
            use_tqdm=False,
        )
        # ignore_eos: nothing is banned, the greedy path is the probe's
        (ignoring,) = eos_llm.generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, ignore_eos=True), use_tqdm=False
        )
    finally:
        executor.eos_token_ids = saved
    assert at_once.token_ids == [first] and at_once.outputs[0].finish_reason == "stop"
    assert at_once.outputs[0].stop_reason is None
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    assert ignoring.token_ids == probe.token_ids


# ---------------------------------------------------------------------------------------------
# 5. Parallel sampling seeds, best_of
# ---------------------------------------------------------------------------------------------

SEED = 1234


def test_parallel_samples_are_reproducible_and_sample_i_is_the_seed_plus_i_run(tiny: LLM) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=SEED, max_tokens=6, ignore_eos=True)
    (a,) = tiny.generate(PROMPT, params, use_tqdm=False)
    (b,) = tiny.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3  # three different samples
    singles = tiny.generate(
        [PROMPT] * 3,
        [SamplingParams(temperature=0.8, seed=SEED + i, max_tokens=6, ignore_eos=True) for i in range(3)],
        use_tqdm=False,
    )
    for c, single in zip(a.outputs, singles, strict=True):
        assert c.token_ids == single.token_ids
        assert c.cumulative_logprob == pytest.approx(single.outputs[0].cumulative_logprob, abs=1e-4)


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(tiny: LLM) -> None:
    (best,) = tiny.generate(
        PROMPT, SamplingParams(n=2, best_of=4, temperature=0.8, seed=SEED, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    # logprobs=0: without them (and with nothing to rank) its outputs report cumulative_logprob None
    (every,) = tiny.generate(
        PROMPT, SamplingParams(n=4, temperature=0.8, seed=SEED, max_tokens=6, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    assert len(best.outputs) == 2 and len(every.outputs) == 4
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    assert ranked[1].cumulative_logprob - ranked[2].cumulative_logprob > 1e-3  # the choice is not a tie
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    for c, ref in zip(best.outputs, ranked[:2], strict=True):
        assert c.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)


# ---------------------------------------------------------------------------------------------
# 6. RequestOutput
# ---------------------------------------------------------------------------------------------


def test_request_output_is_finished_with_ordered_metrics(tiny: LLM) -> None:
    outs = tiny.generate([PROMPT, "Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    for out in outs:
        assert out.finished is True
        assert all(c.finished() for c in out.outputs)
        m = out.metrics
        assert m is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)


def test_requests_jsonl_record_lists_every_completion(tiny: LLM) -> None:
    from paged.api.outputs import request_record
    from paged.engine.metrics import RequestMetrics

    tokenizer = tiny.executor.tokenizer
    request = Request("rec", tokenizer.encode(PROMPT),
                      SamplingParams(n=2, temperature=0.8, seed=SEED, max_tokens=5, ignore_eos=True, logprobs=1))
    tiny.engine.add_request(request)
    drive(tiny.engine)
    record = request_record(request, RequestMetrics.of(request), tokenizer.decode)
    assert [o["index"] for o in record["outputs"]] == [0, 1]
    assert [o["output_token_ids"] for o in record["outputs"]] == [s.output_token_ids for s in request.seqs]
    assert record["output_token_ids"] == record["outputs"][0]["output_token_ids"]
    for o, seq in zip(record["outputs"], request.seqs, strict=True):
        assert o["finish_reason"] == "length"
        assert o["output_text"] == tokenizer.decode(seq.output_token_ids)
        assert len(o["logprobs"]) == 5
        for token, entry in zip(seq.output_token_ids, o["logprobs"], strict=True):
            assert token in [t for t, _, _ in entry]
            assert 1 in [rank for _, _, rank in entry]


# ---------------------------------------------------------------------------------------------
# the real SmolLM2-135M: 3. stop strings, 4. logprobs
# ---------------------------------------------------------------------------------------------

QUESTION = "What is the capital of France?"
MAX_NEW = 12
TOP = 5
PROMPT_TOP = 3


@pytest.fixture(scope="module")
def smollm():
    from paged.executor.model_executor import ModelExecutor
    from paged.model.locate import locate_smollm2

    try:
        locate_smollm2()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ModelExecutor(
        ModelConfig(name="smollm2-135m", source="gguf", chat_template=True),
        KernelConfig(name="test", version="v1", backend="torch", partition_size=16),
    )


@pytest.fixture(scope="module")
def real(smollm) -> LLM:
    return LLM("smollm2-135m", executor=smollm, allocator="naive", overrides=["allocator.num_blocks=32"])


@pytest.fixture(scope="module")
def greedy(real: LLM):
    """Greedy, no stop strings, with top-5 logprobs and top-3 prompt logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOP, prompt_logprobs=PROMPT_TOP)
    (out,) = real.generate(QUESTION, params, use_tqdm=False)
    return out


@pytest.fixture(scope="module")
@torch.inference_mode()
def reference(smollm, greedy):
    """transformers on the same GGUF: (transition scores of its greedy generate, its tokens,
    teacher-forced log-softmax over the prompt)."""
    hf, _ = smollm2_reference(smollm.arch)
    prompt = torch.tensor([greedy.prompt_token_ids])
    out = hf.generate(prompt, do_sample=False, max_new_tokens=len(greedy.token_ids), output_scores=True,
                      return_dict_in_generate=True)
    scores = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    # compute_transition_scores normalises a transposed float32 [vocab, steps] view: its log_softmax
    # is off by up to ~2e-4 from log_softmax over each step's row. The same gather, normalised in float64:
    exact = hf.compute_transition_scores(out.sequences, tuple(torch.log_softmax(s.double(), -1) for s in out.scores))[0]
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    prompt_logprobs = torch.log_softmax(hf(prompt).logits[0].double(), dim=-1)
    return scores.tolist(), exact.tolist(), tokens, prompt_logprobs


@pytest.mark.slow
def test_greedy_ends_at_eos_with_no_stop_reason(real: LLM, greedy) -> None:
    (c,) = greedy.outputs
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.token_ids[-1] in real.executor.eos_token_ids


@pytest.mark.slow
def test_logprobs_top5_ranks_and_hf_transition_scores(real: LLM, greedy, reference) -> None:
    hf_scores, hf_exact, hf_tokens, _ = reference
    (c,) = greedy.outputs
    assert hf_tokens == c.token_ids  # same greedy path, so the scores are comparable
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    tokenizer = real.executor.tokenizer
    chosen = []
    for token, entry, hf_lp, hf_exact_lp in zip(c.token_ids, c.logprobs, hf_scores, hf_exact, strict=True):
        assert token in entry and entry[token].rank == 1
        top = [lp for lp in entry.values() if lp.rank <= TOP]
        assert sorted(lp.rank for lp in top) == list(range(1, TOP + 1))
        assert len(entry) == TOP  # greedy: the chosen token is one of the top 5
        assert sum(math.exp(lp.logprob) for lp in top) <= 1 + 1e-6
        assert all(lp.logprob <= 0 for lp in entry.values())
        by_rank = sorted(top, key=lambda lp: lp.rank)
        assert all(x.logprob >= y.logprob for x, y in zip(by_rank, by_rank[1:]))
        assert entry[token].logprob == pytest.approx(hf_exact_lp, abs=1e-4)
        assert entry[token].logprob == pytest.approx(hf_lp, abs=5e-4)  # normalize_logits=True as HF does it
        assert entry[token].decoded_token == tokenizer.decode([token], skip_special_tokens=False)
        chosen.append(entry[token].logprob)
    assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-5)


@pytest.mark.slow
def test_prompt_logprobs_match_a_teacher_forced_hf_pass(greedy, reference) -> None:
    *_, hf_lp = reference
    prompt = greedy.prompt_token_ids
    entries = greedy.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i in range(1, len(prompt)):
        entry, token = entries[i], prompt[i]
        assert entry is not None and token in entry
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert entry[token].logprob == pytest.approx(float(hf_lp[i - 1, token]), abs=1e-4)
        top = sorted((lp for lp in entry.values() if lp.rank <= PROMPT_TOP), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, PROMPT_TOP + 1))
        expected = hf_lp[i - 1].topk(PROMPT_TOP).values.tolist()
        assert [lp.logprob for lp in top] == pytest.approx(expected, abs=1e-4)
        # the token's rank is where its log-probability sits in HF's sorted row
        ranked = hf_lp[i - 1].sort(descending=True).values
        assert float(ranked[entry[token].rank - 1]) == pytest.approx(float(hf_lp[i - 1, token]), abs=1e-4)


def spanning_stop(tokenizer, token_ids: list[int], text: str) -> tuple[str, int, int]:
    """A stop string made of the last 2 characters of one token and the first 2 of the next, whose
    first occurrence in `text` is there: (string, its start in text, index of the token ending it)."""
    for k in range(len(token_ids) // 2, len(token_ids) - 1):
        before = tokenizer.decode(token_ids[:k])
        through = tokenizer.decode(token_ids[: k + 1])
        if not text.startswith(through) or len(before) < 2 or len(through) - len(before) < 2:
            continue
        b = len(before)
        stop = text[b - 2 : b + 2]
        if text.find(stop) == b - 2 and stop.strip() == stop:
            return stop, b - 2, k
    raise AssertionError(f"no stop string spans a token boundary in {text!r}")


@pytest.fixture(scope="module")
def stop_case(real: LLM, greedy):
    tokenizer = real.executor.tokenizer
    base = greedy.outputs[0]
    stop, start, k = spanning_stop(tokenizer, base.token_ids, base.text)
    stop_token = next(t for i, t in enumerate(base.token_ids) if i >= 2 and t not in base.token_ids[:i])
    outs = real.generate(
        [QUESTION] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[stop]),
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=stop, include_stop_str_in_output=True),
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop_token]),
        ],
        use_tqdm=False,
    )
    return base, stop, start, k, stop_token, outs


@pytest.mark.slow
def test_stop_string_spanning_a_token_boundary_cuts_the_text(real: LLM, stop_case) -> None:
    base, stop, start, k, _, outs = stop_case
    tokenizer = real.executor.tokenizer
    # the stop string's characters come from two tokens: neither alone holds it
    assert stop not in tokenizer.decode(base.token_ids[:k])
    assert stop in tokenizer.decode(base.token_ids[: k + 1])
    assert stop not in tokenizer.decode([base.token_ids[k]])
    assert stop not in tokenizer.decode([base.token_ids[k - 1]])

    (cut,) = outs[0].outputs
    assert cut.text == base.text[:start]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == base.token_ids[: k + 1]

    (kept,) = outs[1].outputs
    assert kept.text == base.text[: start + len(stop)]
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    assert kept.token_ids == base.token_ids[: k + 1]


@pytest.mark.slow
def test_stop_token_id_is_the_stop_reason(stop_case) -> None:
    base, _, _, _, stop_token, outs = stop_case
    (c,) = outs[2].outputs
    i = base.token_ids.index(stop_token)
    assert c.token_ids == base.token_ids[: i + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_token)
    assert c.text == base.text[: len(c.text)] and c.text.strip()


@pytest.mark.slow
def test_prompt_logprobs_computed_chunk_by_chunk_equal_one_pass(smollm, greedy) -> None:
    chunked = LLM("smollm2-135m", executor=smollm, allocator="naive",
                  overrides=["allocator.num_blocks=32", "scheduler.max_num_batched_tokens=16"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOP, prompt_logprobs=PROMPT_TOP)
    (out,) = chunked.generate(QUESTION, params, use_tqdm=False)
    assert len(greedy.prompt_token_ids) > 2 * 16  # at least three chunks
    assert out.token_ids == greedy.token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(greedy.prompt_logprobs)
    for mine, whole in zip(out.prompt_logprobs[1:], greedy.prompt_logprobs[1:], strict=True):
        assert mine.keys() == whole.keys()
        for token, lp in mine.items():
            assert lp.logprob == pytest.approx(whole[token].logprob, abs=1e-5) and lp.rank == whole[token].rank
