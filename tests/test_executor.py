"""ModelExecutor on the tiny random model, driven by hand-built SchedulerOutputs: paged-cache
generation must equal recomputing the whole sequence without a cache, whatever the cache did."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from paged import kernels
from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.model.layer_ops import NATIVE_CPU_OPS, TORCH_OPS
from paged.model.linear import describe_gemm
from paged.model.llama import LlamaModel
from paged.request import Request, SamplingParams
from paged.step import ScheduledSeq, SchedulerOutput

BLOCK = 16


def make_executor(version: str = "auto", partition_size: int = 32, dtype: str = "float32", **arch) -> ModelExecutor:
    ex = ModelExecutor(
        ModelConfig(name="tiny-random", source="random", dtype=dtype, arch=arch),
        KernelConfig(name="test", version=version, backend="torch", partition_size=partition_size),
    )
    ex.init_kv_cache(num_blocks=256, block_size=BLOCK)
    return ex


def contiguous_tables(lengths: list[int], first_block: int = 0) -> list[list[int]]:
    """A trivial block assignment: each sequence gets consecutive blocks for `length` tokens."""
    tables, nxt = [], first_block
    for n in lengths:
        count = -(-n // BLOCK)
        tables.append(list(range(nxt, nxt + count)))
        nxt += count
    return tables


def step(ex: ModelExecutor, items: list[ScheduledSeq], prefill: bool, copies=()) -> list[list[int]]:
    """Execute and apply the outputs the way the engine does."""
    out = ex.execute(SchedulerOutput(items, is_prefill=prefill, blocks_to_copy=list(copies)))
    assert out.num_computed_tokens == sum(it.num_new_tokens for it in items)
    for it, toks in zip(items, out.sampled, strict=True):
        it.seq.num_computed_tokens += it.num_new_tokens
        it.seq.token_ids.extend(toks[:1])
    return out.sampled


def generate(ex: ModelExecutor, prompts: list[list[int]], max_tokens: int, params: SamplingParams | None = None):
    """Prefill all prompts in one step, then decode them together; returns the output ids."""
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [Request(str(i), p, params).seqs[0] for i, p in enumerate(prompts)]
    tables = contiguous_tables([len(p) + max_tokens for p in prompts])
    step(ex, [ScheduledSeq(s, s.num_tokens, t) for s, t in zip(seqs, tables, strict=True)], prefill=True)
    for _ in range(max_tokens - 1):
        step(ex, [ScheduledSeq(s, 1, t) for s, t in zip(seqs, tables, strict=True)], prefill=False)
    return [s.output_token_ids for s in seqs]


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1)


@torch.inference_mode()
def recompute_greedy(model: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    """No cache at all: the whole sequence through the model for every token."""
    ids = list(prompt)
    for _ in range(max_tokens):
        t = torch.tensor(ids)
        hidden = model.forward(t, torch.arange(len(ids)), causal_attention)
        ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt) :]


PROMPTS = [list(range(100, 137)), [5, 6, 7], list(range(2000, 2050, 2)), [42]]


@pytest.fixture(scope="module")
def tiny() -> ModelExecutor:
    return make_executor()


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "auto"])
def test_paged_generation_equals_full_recompute(version: str) -> None:
    ex = make_executor(version=version, partition_size=16)
    outputs = generate(ex, PROMPTS, max_tokens=12)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out == recompute_greedy(ex.model, prompt, 12)


def test_cache_layout_and_block_bytes() -> None:
    ex = make_executor(dtype="bfloat16")
    a = ex.arch
    assert ex.key_caches[0].shape == (256, a.num_kv_heads, a.head_dim // 8, BLOCK, 8)
    assert ex.value_caches[0].shape == (256, a.num_kv_heads, a.head_dim, BLOCK)
    assert len(ex.key_caches) == a.num_layers
    assert ex.kv_cache_spec(BLOCK).bytes_per_block == 2 * a.num_layers * BLOCK * a.num_kv_heads * a.head_dim * 2
    assert generate(ex, [[1, 2, 3]], max_tokens=3)[0]


def test_prefix_hit_skips_cached_tokens(tiny: ModelExecutor) -> None:
    shared = list(range(300, 332))  # two full blocks
    first = Request("a", shared + [7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0)).seqs[0]
    second = Request("b", shared + [10, 11], SamplingParams(max_tokens=4, temperature=0.0)).seqs[0]
    step(tiny, [ScheduledSeq(first, first.num_tokens, [0, 1, 2])], prefill=True)
    before = tiny.num_prefill_tokens_computed
    second.num_computed_tokens = len(shared)  # the allocator's prefix hit: blocks 0 and 1
    step(tiny, [ScheduledSeq(second, 2, [0, 1, 5])], prefill=True)
    assert tiny.num_prefill_tokens_computed - before == 2
    assert second.output_token_ids == recompute_greedy(tiny.model, second.token_ids[:-1], 1)


def test_chunked_prefill_and_mixed_batch_match_recompute(tiny: ModelExecutor) -> None:
    prompt = list(range(600, 650))
    seq = Request("c", prompt, SamplingParams(max_tokens=3, temperature=0.0)).seqs[0]
    other = Request("d", [9, 8, 7, 6], SamplingParams(max_tokens=3, temperature=0.0)).seqs[0]
    t_seq, t_other = contiguous_tables([60, 10], first_block=20)
    assert step(tiny, [ScheduledSeq(seq, 20, t_seq, num_samples=0)], prefill=True) == [[]]
    step(tiny, [ScheduledSeq(seq, 30, t_seq), ScheduledSeq(other, 4, t_other)], prefill=True)
    step(tiny, [ScheduledSeq(seq, 1, t_seq), ScheduledSeq(other, 1, t_other)], prefill=False)
    assert seq.output_token_ids == recompute_greedy(tiny.model, prompt, 2)
    assert other.output_token_ids == recompute_greedy(tiny.model, [9, 8, 7, 6], 2)


def test_copy_on_write_blocks_are_copied_before_attention(tiny: ModelExecutor) -> None:
    parent = Request("e", list(range(700, 720)), SamplingParams(max_tokens=4, temperature=0.0)).seqs[0]
    step(tiny, [ScheduledSeq(parent, parent.num_tokens, [40, 41])], prefill=True)
    child = parent.fork(1)
    # The child shares block 40 and gets a private copy of the partly filled block 41.
    step(tiny, [ScheduledSeq(parent, 1, [40, 41]), ScheduledSeq(child, 1, [40, 42])], prefill=False, copies=[(41, 42)])
    assert child.token_ids == parent.token_ids


def test_sampling_survives_recompute_after_preemption(tiny: ModelExecutor) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    straight = generate(tiny, [[11, 12, 13, 14]], 8, params)[0]
    seq = Request("0", [11, 12, 13, 14], params).seqs[0]
    step(tiny, [ScheduledSeq(seq, 4, [60])], prefill=True)
    for _ in range(3):
        step(tiny, [ScheduledSeq(seq, 1, [60])], prefill=False)
    seq.num_computed_tokens = 0  # preempted: the engine recomputes prompt + outputs elsewhere
    step(tiny, [ScheduledSeq(seq, seq.num_tokens, [70])], prefill=True)
    while seq.num_output_tokens < 8:
        step(tiny, [ScheduledSeq(seq, 1, [70])], prefill=False)
    assert seq.output_token_ids == straight


def test_unseeded_sampling_is_reproducible_under_the_executor_seed(tiny: ModelExecutor) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0)
    assert generate(tiny, [[3, 4, 5]], 6, params) == generate(tiny, [[3, 4, 5]], 6, params)


def test_first_step_of_n_draws_num_samples_tokens(tiny: ModelExecutor) -> None:
    seq = Request("f", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=1.5, seed=3, n=4)).seqs[0]
    out = tiny.execute(SchedulerOutput([ScheduledSeq(seq, 5, [80], num_samples=4)], is_prefill=True))
    assert len(out.sampled[0]) == 4
    assert len(set(out.sampled[0])) > 1


def test_random_arch_overrides_from_a_hydra_config_and_qkv_bias() -> None:
    model_cfg = OmegaConf.structured(
        ModelConfig(name="tiny-random", source="random", arch={"num_layers": 1, "num_kv_heads": 2, "qkv_bias": True})
    )
    ex = ModelExecutor(model_cfg, OmegaConf.structured(KernelConfig(name="test")))
    ex.init_kv_cache(num_blocks=8, block_size=BLOCK)
    assert ex.arch.num_layers == 1 and ex.arch.qkv_bias
    assert generate(ex, [[1, 2, 3, 4]], 5)[0] == recompute_greedy(ex.model, [1, 2, 3, 4], 5)


def test_unknown_arch_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown LlamaArch keys"):
        make_executor(num_layer=3)


@pytest.mark.parametrize("gemm", ["torch", "onednn", "auto"])
def test_native_layer_ops_and_gemms_generate_what_the_torch_formulas_recompute(gemm: str) -> None:
    """On the native cpu backend the norms, RoPE and SwiGLU are the native kernels; they keep the
    torch formulas' fp32 results, so paged generation (decode on v3, `auto`'s pick on cpu) equals a
    torch-ops full recompute exactly."""
    ex = ModelExecutor(
        ModelConfig(name="tiny-random", source="random", gemm=gemm),
        KernelConfig(name="test", version="auto", backend="cpu", partition_size=32),
    )
    ex.init_kv_cache(num_blocks=256, block_size=BLOCK)
    if ex.backend.name != "cpu":
        pytest.skip(f"native cpu backend unavailable: {ex.kernel_description}")
    assert ex.model.ops is NATIVE_CPU_OPS
    assert f"gemm {describe_gemm(ex.gemm, ex.dtype)}, native norms/RoPE/SwiGLU" in ex.description
    assert kernels.choose_version(100, len(PROMPTS), ex.arch.num_heads, backend=ex.backend.name) == "v3"
    outputs = generate(ex, PROMPTS, max_tokens=8)
    ex.model.ops = TORCH_OPS
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out == recompute_greedy(ex.model, prompt, 8)


def test_a_position_past_the_rope_table_is_refused_before_the_forward() -> None:
    """The fused RoPE kernels look positions up on the device, where nothing checks them."""
    ex = make_executor(max_position_embeddings=16)
    ex.init_kv_cache(num_blocks=64, block_size=BLOCK)
    with pytest.raises(ValueError, match="position 19 is past the model's max_position_embeddings=16"):
        generate(ex, [list(range(1, 21))], max_tokens=1)


@pytest.mark.parametrize(("version", "runs"), [("auto", {"v3"}), ("vllm", {"v1", "v2"})])
def test_kernel_vllm_runs_vllms_rule_where_auto_runs_v3(version: str, runs: set[str]) -> None:
    """On the cpu backend (as on cuda) `auto` decodes with v3; `vllm` keeps vLLM's v1/v2 rule, the
    paper presets' choice, and the summary counts the steps by the kernel that ran them."""
    from paged.experiment.run import run_quietly

    overrides = ["model=tiny-random", "model.device=cpu", f"kernel={version}", "kernel.backend=cpu",
                 "workload=fixed", "workload.num_requests=3", "workload.prompt_len=20", "workload.output_len=6"]
    summary, engine = run_quietly(overrides)
    if engine.executor.backend.name != "cpu":
        pytest.skip(f"native cpu backend unavailable: {engine.executor.kernel_description}")
    counts = {v for v in ("v1", "v2", "v3") if summary[f"decode_steps_{v}"]}
    assert counts and counts <= runs
    assert engine.executor.kernel_description.startswith({"auto": "auto(v3)", "vllm": "vllm(v1/v2)"}[version])
