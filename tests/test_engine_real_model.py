"""The whole engine on the real SmolLM2-135M: HF parity through `LLM`, preemption invariance and
prefix caching, with the requests batched so continuous batching with mixed lengths is exercised.

The reference is transformers decoding with `generate(do_sample=False)` on its own conversion of the
same GGUF (`load_gguf_checkpoint`: dequantisation and Q/K de-permutation), the code behind
`from_pretrained(gguf_file=...)`, called directly because from_pretrained parses the GGUF twice
(config, then tensors), about 10 s more on a 2-core machine.

The model loads once: every engine shares one executor (`LLM(executor=...)` re-initialises its KV
cache), one engine at a time, and the kernel version is switched on it the way
test_model_parity.py does, since an executor reads `kernel.version` only when it is built.
"""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams
from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.executor.model_executor import ModelExecutor
from tests.hf_reference import arch_kwargs, smollm2_reference

pytestmark = pytest.mark.slow

MAX_NEW = 16
PARTITION = 32  # v2 reduces over several partitions at these lengths
ROOMY = "allocator.num_blocks=64"  # 1024 tokens: nothing is preempted
PROMPTS = [
    "The capital of France is",
    "Paged attention borrows an old idea from operating systems. Explain it in one sentence:",
    "Serving a large language model is mostly a memory problem. Every request keeps the keys and values of "
    "all the tokens it has seen. Why does reserving space for the longest answer waste memory?",
    "A good experiment changes one thing at a time. It fixes the model, the requests and the hardware, and "
    "swaps only the allocator, the scheduling policy or the attention kernel. It records the throughput and "
    "the latency of every request. Write a short list of three things such an experiment should record:",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived",
]


def llm_on(executor: ModelExecutor, allocator: str, version: str, *overrides: str) -> LLM:
    executor.version = version
    return LLM("smollm2-135m", allocator=allocator, kernel=version, overrides=overrides, executor=executor)


@pytest.fixture(scope="module")
def executor() -> ModelExecutor:
    # the HF reference decodes in fp32; model.dtype=auto would be bf16 on a GPU
    cfg = compose_config(["model=smollm2-135m", "model.dtype=float32", f"kernel.partition_size={PARTITION}"])
    return build_executor(cfg)


@pytest.fixture(scope="module")
def prompt_ids(executor) -> list[list[int]]:
    ids = [executor.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, ids)) + MAX_NEW > 2 * PARTITION
    return ids


@pytest.fixture(scope="module")
@torch.inference_mode()
def hf_greedy(executor, prompt_ids) -> list[list[int]]:
    hf, config = smollm2_reference(executor.arch)
    arch = arch_kwargs(executor.arch)
    assert {k: config[k] for k in arch} == arch  # the config transformers reads from the GGUF
    outs = [hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW) for ids in prompt_ids]
    return [out[0, len(ids) :].tolist() for ids, out in zip(prompt_ids, outs, strict=True)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_chunked_prefill_with_mixed_steps_keeps_greedy_outputs(executor, prompt_ids, hf_greedy, backend) -> None:
    """Prompts longer than the 24-token budget run in chunks, beside other requests' decode rows."""
    llm = llm_on(executor, "prefix", "v2", ROOMY, "scheduler.max_num_batched_tokens=24", f"kernel.backend={backend}")
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == hf_greedy
    steps = llm.engine.metrics.steps
    assert max(s.num_scheduled_tokens for s in steps) <= 24
    assert any(s.is_prefill and s.num_decode_rows for s in steps)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("allocator", ["naive", "prefix"])
def test_batched_greedy_outputs_equal_hf_generate(executor, prompt_ids, hf_greedy, allocator, version) -> None:
    llm = llm_on(executor, allocator, version, ROOMY)
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == hf_greedy  # HF stops at EOS too, and keeps it
    assert "Paris" in outs[0].text
    assert llm.engine.kv_stats().num_allocated_blocks == 0


@pytest.mark.parametrize("allocator", ["naive", "prefix"])
def test_repeated_preemption_keeps_greedy_outputs(executor, prompt_ids, hf_greedy, allocator) -> None:
    # 13 blocks of 16 for six sequences that grow to 21..78 tokens (18 blocks in all)
    llm = llm_on(executor, allocator, "v2", "allocator.num_blocks=13", "allocator.block_size=16")
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == hf_greedy  # what the unconstrained runs above produce
    assert llm.engine.scheduler.counters.num_preemptions >= 2
    assert llm.engine.kv_stats().num_allocated_blocks == 0


@pytest.fixture(scope="module")
def unconstrained(executor, prompt_ids) -> list[list[int]]:
    llm = llm_on(executor, "naive", "v2", ROOMY)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
    return [o.token_ids for o in llm.generate(prompt_ids, params)]


@pytest.mark.parametrize(
    ("allocator", "mode"),
    # forced recompute on naive and prefix: test_repeated_preemption_keeps_greedy_outputs
    [("naive", "swap"), ("prefix", "swap"), ("orca-max", "swap"), ("orca-pow2", "recompute"), ("orca-oracle", "swap")],
)
def test_forced_preemption_keeps_greedy_outputs(executor, prompt_ids, unconstrained, allocator, mode) -> None:
    # 13 blocks of 16 for six sequences that grow to 21..78 tokens: the paged allocators preempt;
    # an Orca reservation (at most 128 slots here) covers a sequence's whole life, so it queues instead
    llm = llm_on(executor, allocator, "v2", "allocator.num_blocks=13", "allocator.block_size=16",
                 "scheduler.max_model_len=128", f"scheduler.preemption_mode={mode}", "allocator.swap_space=64MiB")
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0))
    assert [o.token_ids for o in outs] == unconstrained
    counters = llm.engine.scheduler.counters
    if allocator.startswith("orca"):
        assert counters.num_preemptions == 0
    else:
        assert counters.num_preemptions >= 2
        assert (counters.num_swaps_out > 0) == (mode == "swap")
        assert counters.num_swaps_in == counters.num_swaps_out
    assert llm.engine.kv_stats().num_allocated_blocks == 0


def test_prefix_cache_computes_only_uncached_tokens_with_naive_outputs(executor) -> None:
    tokenizer = executor.tokenizer
    shared = tokenizer.encode(" ".join(PROMPTS[1:]))[:96]  # six full blocks of 16
    questions = [" Summarise this.", " What is a block?", " Who wrote it?", " Is it fast? Answer yes or no."]
    prompts = [shared + tokenizer.encode(q) for q in questions]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)

    naive = llm_on(executor, "naive", "v2", ROOMY)
    before = executor.num_prefill_tokens_computed
    expected = [o.token_ids for o in naive.generate(prompts, params)]
    assert executor.num_prefill_tokens_computed - before == sum(map(len, prompts))

    prefix = llm_on(executor, "prefix", "v2", ROOMY)
    first = prefix.generate(prompts[:1], params)
    before = executor.num_prefill_tokens_computed
    rest = prefix.generate(prompts[1:], params)
    assert executor.num_prefill_tokens_computed - before == sum(len(p) - 96 for p in prompts[1:])
    assert prefix.engine.kv_stats().num_hit_tokens == 3 * 96
    assert [o.token_ids for o in first + rest] == expected
