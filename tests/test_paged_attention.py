"""The executor's attention callback on a step that mixes decode rows (one new token) and prefill
rows (whole prompts, or the tokens after a prefix-cache hit): one kernel call per kind, rows back in
batch order, the same answer as running each kind alone and as per-sequence attention."""

from __future__ import annotations

import pytest
import torch

from paged.config import KernelConfig, ModelConfig
from paged.executor.attention import PagedAttention
from paged.executor.model_executor import ModelExecutor
from paged.executor.step_plan import InputBuffers, plan_batch
from paged.kernels import get_backend
from paged.kernels.planned import AttentionSettings
from paged.kernels.testing import causal_attention, gather_kv, random_cache
from paged.kernels.toolchain import host_compiler
from paged.request import Request, SamplingParams
from paged.step import ScheduledSeq, SchedulerOutput
from tests.test_executor import contiguous_tables, recompute_greedy, step

pytestmark = pytest.mark.compiles

BLOCK, KV_HEADS, HEADS, HEAD_SIZE = 16, 2, 6, 64
# (prompt length, tokens already computed): decode, whole prompt, prefix hit, decode, chunk
SEQS = ((30, 29), (20, 0), (40, 32), (17, 16), (50, 20))


_NO_COMPILER = host_compiler.unavailable_reason()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
BACKENDS = ["torch", pytest.param("cpu", marks=needs_compiler)]


def _scheduled(picks: list[int]) -> list[ScheduledSeq]:
    tables = contiguous_tables([n for n, _ in SEQS])
    items = []
    for i in picks:
        length, computed = SEQS[i]
        seq = Request(str(i), list(range(length)), SamplingParams(max_tokens=1, temperature=0.0)).seqs[0]
        seq.num_computed_tokens = computed
        items.append(ScheduledSeq(seq, length - computed, tables[i]))
    return items


def _attend(picks: list[int], qkv: dict[int, tuple[torch.Tensor, ...]], caches: tuple[torch.Tensor, torch.Tensor],
            backend: str) -> tuple[torch.Tensor, PagedAttention]:
    batch = InputBuffers(torch.device("cpu")).upload(plan_batch(SchedulerOutput(_scheduled(picks)), BLOCK))
    version = "v2" if batch.decode else None
    settings = AttentionSettings(get_backend(backend), HEAD_SIZE**-0.5, partition_size=16)
    attn = PagedAttention(batch, [caches[0]], [caches[1]], settings, decode_version=version, num_heads=HEADS)
    q, k, v = (torch.cat([qkv[i][j] for i in picks]) for j in range(3))
    return attn(0, q, k, v), attn


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_step_equals_decode_and_prefill_alone_and_per_sequence_attention(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = random_cache(64, KV_HEADS, HEAD_SIZE, BLOCK, torch.float32, generator=gen)
    qkv = {}
    for i, (length, computed) in enumerate(SEQS):
        n = length - computed
        qkv[i] = (torch.randn(n, HEADS, HEAD_SIZE, generator=gen), torch.randn(n, KV_HEADS, HEAD_SIZE, generator=gen),
                  torch.randn(n, KV_HEADS, HEAD_SIZE, generator=gen))
    mixed, attn = _attend(list(range(len(SEQS))), qkv, (key_cache, value_cache), backend)
    decode_op = attn.layers[0][0].decode  # layer 0's (ops, KV tensor)
    assert decode_op is not None and decode_op.version == "v2"
    assert attn.batch.decode_tokens.tolist() == [0, 29]
    assert attn.batch.prefill.query_start_loc.tolist() == [0, 20, 28, 58]

    decode, alone = _attend([0, 3], qkv, (key_cache.clone(), value_cache.clone()), backend)
    assert alone.batch.decode_tokens is None and alone.batch.prefill is None
    prefill, alone = _attend([1, 2, 4], qkv, (key_cache.clone(), value_cache.clone()), backend)
    assert alone.layers[0][0].decode is None and alone.batch.prefill_tokens is None
    torch.testing.assert_close(mixed[[0, 29]], decode, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[torch.cat([torch.arange(1, 29), torch.arange(30, 60)])], prefill,
                               atol=1e-5, rtol=1e-5)

    start = 0
    for i, (length, computed) in enumerate(SEQS):
        keys, values = gather_kv(key_cache, value_cache, torch.tensor(contiguous_tables([n for n, _ in SEQS])[i]),
                                 length)
        end = start + length - computed
        expected = causal_attention(qkv[i][0], keys, values, HEAD_SIZE**-0.5)
        torch.testing.assert_close(mixed[start:end], expected, atol=1e-5, rtol=1e-5)
        start = end


def test_cache_writes_land_before_attention_reads_them() -> None:
    """A prefill row attends to its own new tokens, so they must be in the cache first."""
    key_cache, value_cache = random_cache(64, KV_HEADS, HEAD_SIZE, BLOCK, torch.float32)
    q = torch.randn(20, HEADS, HEAD_SIZE)
    v = torch.randn(20, KV_HEADS, HEAD_SIZE)
    out, _ = _attend([1], {1: (q, torch.randn(20, KV_HEADS, HEAD_SIZE), v)}, (key_cache, value_cache), "torch")
    torch.testing.assert_close(out[0], v[0].repeat_interleave(HEADS // KV_HEADS, dim=0))


def test_a_step_mixing_decode_and_prefill_generates_like_full_recompute() -> None:
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random"), KernelConfig(name="t", backend="torch"))
    ex.init_kv_cache(num_blocks=64, block_size=BLOCK)
    first = Request("a", list(range(100, 121)), SamplingParams(max_tokens=3, temperature=0.0)).seqs[0]
    second = Request("b", list(range(300, 340)), SamplingParams(max_tokens=2, temperature=0.0)).seqs[0]
    t_first, t_second = contiguous_tables([30, 50])
    t_second = [b + 10 for b in t_second]
    step(ex, [ScheduledSeq(first, first.num_tokens, t_first)], prefill=True)
    step(ex, [ScheduledSeq(first, 1, t_first), ScheduledSeq(second, second.num_tokens, t_second)], prefill=True)
    step(ex, [ScheduledSeq(first, 1, t_first), ScheduledSeq(second, 1, t_second)], prefill=False)
    assert first.output_token_ids == recompute_greedy(ex.model, list(range(100, 121)), 3)
    assert second.output_token_ids == recompute_greedy(ex.model, list(range(300, 340)), 2)


@needs_compiler
def test_auto_resolves_the_backend_once_and_says_why() -> None:
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"), KernelConfig(name="t"))
    assert ex.backend.name == "cpu"
    assert ex.kernel_description == (
        "auto(v3)/cpu (native C++/OpenMP; auto: backend='cuda' needs cuda tensors, got tensors on cpu)"
    )
