"""A KV cache in another float dtype than the model's (`kernel.kv_cache_dtype` float32 / bfloat16) and
the CPU's model dtypes: the cpu kernels over a mixed pair against the torch reference on the same
values, the converting cache write byte for byte, a bf16 model end to end over fp32 and bf16 caches,
and the refusals (float16 on a CPU, a backend that keeps its cache in the model dtype, an unknown
cache dtype) and the warning of bf16 on a CPU without bf16 arithmetic."""

from __future__ import annotations

import logging

import pytest
import torch

from paged import kernels
from paged.api.llm import LLM
from paged.config import ConfigError, compose_config, validate
from paged.engine.builder import build_engine
from paged.executor import dtype_checks, model_executor
from paged.kernels.backends import torch_ref
from paged.kernels.backends.torch_ref import TorchBackend
from paged.kernels.testing import AttentionCase, attention_inputs, gather_kv, prefill_inputs, tolerance
from paged.request import SamplingParams
from tests.test_executor_swap import SWAP_PARAMS, SWAP_PROMPTS

BF16, F32 = torch.bfloat16, torch.float32
# (query dtype, cache dtype): a bf16 model over an fp32 cache, an fp32 one over a bf16 cache
PAIRS = [(BF16, F32), (F32, BF16)]
# GQA 4, a block of 16 (x = 4 for fp32, 8 for bf16), contexts ending mid-block and past a v2 partition
CASE = AttentionCase(BF16, 64, 16, 4, 2, 32, (1, 15, 17, 70))
PROMPTS = [[(31 * n + 7 * i) % 40000 for i in range(n)] for n in (21, 40, 9)]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)


def relayout(key_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A key cache `[n, h, d/x, bs, x]` in `dtype`, whose x is 16 // its element size."""
    n, h, _, bs, _ = key_cache.shape
    x = 16 // dtype.itemsize
    tokens = key_cache.permute(0, 1, 3, 2, 4).reshape(n, h, bs, -1).to(dtype)
    return tokens.reshape(n, h, bs, -1, x).permute(0, 1, 3, 2, 4).contiguous()


def _caches(query_dtype: torch.dtype, cache_dtype: torch.dtype):  # noqa: ANN202
    """Inputs whose caches hold bf16 values (exact in both dtypes) in `cache_dtype`, NaN past each
    sequence's end (`key_cache`) or zero there (`clean_*`, the reference's)."""
    x = attention_inputs(CASE)
    caches = [relayout(x.key_cache, cache_dtype), x.value_cache.to(cache_dtype),
              relayout(x.clean_key_cache, cache_dtype), x.clean_value_cache.to(cache_dtype)]
    return x, x.query.to(query_dtype), caches


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), PAIRS)
@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_cpu_decode_over_another_cache_dtype_matches_torch_reference(query_dtype, cache_dtype, version) -> None:
    x, query, (key, value, clean_key, clean_value) = _caches(query_dtype, cache_dtype)
    assert key.shape[-1] == 16 // cache_dtype.itemsize
    options = {"version": version, "partition_size": 32}
    out = kernels.paged_attention(query, key, value, x.block_tables, x.seq_lens, x.scale, backend="cpu", **options)
    ref = kernels.paged_attention(query, clean_key, clean_value, x.block_tables, x.seq_lens, x.scale, backend="torch",
                                  **options)
    assert out.dtype == query_dtype
    torch.testing.assert_close(out, ref, **tolerance(BF16))


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), PAIRS)
def test_cpu_prefill_over_another_cache_dtype_matches_torch_reference(query_dtype, cache_dtype) -> None:
    p = prefill_inputs(CASE, (1, 5, 17, 30))
    _, _, (key, value, clean_key, clean_value) = _caches(query_dtype, cache_dtype)
    query, tables, starts, lens = p.query.to(query_dtype), p.paged.block_tables, p.query_start_loc, p.paged.seq_lens
    out = kernels.prefill_attention(query, key, value, tables, starts, lens, p.paged.scale, backend="cpu")
    ref = kernels.prefill_attention(query, clean_key, clean_value, tables, starts, lens, p.paged.scale,
                                    backend="torch")
    torch.testing.assert_close(out, ref, **tolerance(BF16))


@pytest.mark.parametrize(("key_dtype", "cache_dtype"), PAIRS)
def test_converting_cache_write_stores_what_torch_does(monkeypatch, key_dtype, cache_dtype) -> None:
    """Native (the torch writer is barred), from strided views of a fused qkv, skipping slot -1, the
    cache holding `key.to(cache dtype)` bit for bit."""
    monkeypatch.setattr(TorchBackend, "reshape_and_cache", staticmethod(_no_fallback))
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3, 2, 64, generator=gen).to(key_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, -1, 17, 40, 63, 20])
    x = 16 // cache_dtype.itemsize
    ours = (torch.zeros(4, 2, 64 // x, 16, x, dtype=cache_dtype), torch.zeros(4, 2, 64, 16, dtype=cache_dtype))
    theirs = (ours[0].clone(), ours[1].clone())
    kernels.reshape_and_cache(key, value, *ours, slots, backend="cpu")
    torch_ref.reshape_and_cache(key, value, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    table = torch.arange(4, dtype=torch.int32)
    k, v = gather_kv(*ours, table, 64)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k[slot], key[token].to(cache_dtype))
            assert torch.equal(v[slot], value[token].to(cache_dtype))


def _no_fallback(*_: object, **__: object) -> None:
    raise AssertionError("the cpu backend fell back to the torch cache writer")


def _greedy(*overrides: str) -> tuple[list[list[int]], LLM]:
    llm = LLM("tiny-random", overrides=["model.device=cpu", "model.dtype=bfloat16", *overrides])
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


def test_a_bf16_model_runs_over_float32_and_bfloat16_caches() -> None:
    """A bf16 model's K/V widen to fp32 exactly and attention reads either cache as fp32, so an fp32
    cache gives the bf16 cache's tokens (only the fp32 summation order over x = 4 vs 8 tiles differs),
    on the cpu backend and the torch reference alike."""
    own, _ = _greedy("kernel.backend=cpu")
    wide, llm = _greedy("kernel.backend=cpu", "kernel.kv_cache_dtype=float32")
    ex = llm.engine.executor
    assert ex.key_caches[0].dtype == F32 and ex.key_caches[0].shape[-1] == 4
    assert "(bfloat16, KV cache float32)" in ex.description
    assert wide == own
    assert _greedy("kernel.backend=torch", "kernel.kv_cache_dtype=float32")[0] == own
    assert _greedy("kernel.backend=cpu", "kernel.kv_cache_dtype=bfloat16")[0] == own
    assert all(len(t) == GREEDY.max_tokens and all(0 <= i < ex.vocab_size for i in t) for t in wide)


def test_a_float32_cache_holds_half_the_blocks_of_a_bf16_one() -> None:
    """Bytes per token follow the cache dtype, not the model's."""
    common = ["model=tiny-random", "logger=none", "progress=false", "model.device=cpu", "model.dtype=bfloat16",
              "allocator.kv_cache_memory=3MiB", "allocator.num_blocks=null"]
    own = build_engine(compose_config(common)).kv_stats().num_total_blocks
    wide = build_engine(compose_config([*common, "kernel.kv_cache_dtype=float32"])).kv_stats().num_total_blocks
    assert own == 2 * wide


def test_swap_preemption_moves_float32_blocks_of_a_bf16_model_unchanged() -> None:
    overrides = ["model.device=cpu", "model.dtype=bfloat16", "kernel.backend=cpu", "kernel.kv_cache_dtype=float32"]
    roomy = LLM("tiny-random", allocator="naive", overrides=overrides).generate(SWAP_PROMPTS, SWAP_PARAMS)
    tight = LLM("tiny-random", allocator="naive", overrides=[
        *overrides, "allocator.num_blocks=8", "scheduler.preemption_mode=swap", "allocator.swap_space=1MiB",
    ])
    outputs = tight.generate(SWAP_PROMPTS, SWAP_PARAMS)
    assert tight.engine.scheduler.counters.num_swapped_blocks > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading weights fails: a refusal must come before it."""
    def refuse(*_: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(model_executor, "load_weights", refuse)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.dtype=float16"], "model.dtype=float16 does not run on a CPU; supported there: float32, bfloat16"),
        (["model.dtype=bfloat16", "kernel.backend=emu", "kernel.kv_cache_dtype=float32"],
         "kernel.backend=emu cannot run model.dtype=bfloat16 with kernel.kv_cache_dtype=float32 on cpu: kv cache "
         "dtype=float32 with dtype=bfloat16 is not supported by backend='emu', which keeps a float cache in the "
         "activations' dtype; supported: bfloat16, float8_e4m3fn, float8_e5m2"),
    ],
)
def test_unserved_dtypes_are_refused_before_weights_load(no_weights, overrides, message) -> None:
    with pytest.raises(ConfigError) as err:
        LLM("tiny-random", overrides=["model.device=cpu", *overrides])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_unknown_kv_cache_dtype_lists_the_allowed_ones() -> None:
    allowed = "allowed: auto, float32, bfloat16, fp8_e4m3, fp8_e5m2"
    with pytest.raises(ConfigError, match=f"kernel.kv_cache_dtype='float16' is not supported; {allowed}"):
        validate(compose_config(["kernel.kv_cache_dtype=float16"]))
    with pytest.raises(ConfigError, match="kv_cache_dtype='float64' is not supported; allowed: auto, fp8, float32"):
        LLM("tiny-random", kv_cache_dtype="float64")


@pytest.mark.parametrize("native", [False, True])
def test_bf16_warns_once_on_a_cpu_without_bf16_arithmetic(monkeypatch, caplog, native: bool) -> None:
    monkeypatch.setattr(dtype_checks, "bf16_arithmetic_supported", lambda: native)
    with caplog.at_level(logging.WARNING, logger="paged"):
        tokens, _ = _greedy("kernel.backend=cpu")
    warnings = [r.getMessage() for r in caplog.records if "AVX512-BF16" in r.getMessage()]
    assert warnings == ([] if native else [
        "model.dtype=bfloat16 on a CPU without AVX512-BF16 or AMX: its bf16 matmuls run emulated through fp32, "
        "typically slower than model.dtype=float32 on this CPU"])
    assert len(tokens) == len(PROMPTS)
