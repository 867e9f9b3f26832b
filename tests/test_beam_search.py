"""Beam search on the real SmolLM2 against HF transformers' `generate(num_beams=k, do_sample=False)`,
token for token (vLLM's own beam-search test makes the same comparison), plus the block sharing it
relies on. The HF reference is the GGUF converted by transformers, as in test_model_parity."""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams
from paged.api.llm import BeamSearchParams
from paged.executor.model_executor import ModelExecutor
from tests.test_model_parity import QUESTIONS, reference, smollm  # noqa: F401 - module fixtures

pytestmark = pytest.mark.slow
MAX_NEW = 10


def make_llm(ex: ModelExecutor, *overrides: str) -> LLM:
    return LLM("smollm2-135m", allocator="naive", kernel="v1", executor=ex,
               overrides=["allocator.num_blocks=256", "model.chat_template=true", *overrides])


@pytest.fixture(scope="module")
def llm(smollm: ModelExecutor) -> LLM:  # noqa: F811
    return make_llm(smollm)


@pytest.fixture(scope="module")
def prompts(smollm: ModelExecutor) -> list[list[int]]:  # noqa: F811
    return [smollm.tokenizer.encode(q) for q in QUESTIONS[:2]]


@torch.inference_mode()
def hf_beam(hf, prompt: list[int], width: int, length_penalty: float, early_stopping) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=MAX_NEW,
        length_penalty=length_penalty, early_stopping=early_stopping, pad_token_id=2, eos_token_id=2,
    )
    tokens = out[0, len(prompt) :].tolist()
    # HF pads a short best hypothesis after its EOS
    return tokens[: tokens.index(2) + 1] if 2 in tokens else tokens


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(1.0, False), (0.5, True)])
def test_beam_search_equals_hf_generate(llm: LLM, reference, prompts, width, length_penalty, early_stopping) -> None:  # noqa: F811
    hf, _ = reference
    params = SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=MAX_NEW,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_beam(hf, prompt, width, length_penalty, early_stopping)
        assert len(out.outputs) == width
        # ranked best first by the length-normalised score HF uses
        scores = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in out.outputs]
        assert scores == sorted(scores, reverse=True)


def test_beams_share_blocks_and_the_no_sharing_baseline_gives_the_same_hypotheses(smollm, prompts) -> None:  # noqa: F811
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW)
    sharing = make_llm(smollm)
    shared = sharing.beam_search(prompts, params)
    # steps after which sequences still hold blocks (the last one frees them all)
    saving = [s.kv_sharing_saving for s in sharing.engine.metrics.steps if not s.is_prefill and s.num_logical_blocks]
    copying = make_llm(smollm, "allocator.share_blocks=false")
    baseline = copying.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in shared] == [[s.tokens for s in o.sequences] for o in baseline]
    assert min(saving) > 0.3  # four beams over one prompt: most of their blocks are shared
    # without sharing a beam copies what it shares before its next step: no saving survives a step
    steps = [s for s in copying.engine.metrics.steps if not s.is_prefill and s.num_logical_blocks]
    assert max(s.kv_sharing_saving for s in steps) < min(saving)
    assert max(s.num_allocated_blocks for s in steps) > max(
        s.num_allocated_blocks for s in sharing.engine.metrics.steps if not s.is_prefill
    )
    assert shared[0].sequences[0].tokens[: len(prompts[0])] == prompts[0]
