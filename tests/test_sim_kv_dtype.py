"""`kernel.kv_cache_dtype` on the simulator: an fp8 cache halves a block's bytes (twice the blocks in
the same memory) and the K/V bytes that attention reads, the cache write stores and a swap moves."""

from __future__ import annotations

import logging

import pytest

from paged.config import ConfigError, compose_config, validate
from paged.engine.builder import build_engine
from paged.sim.cost_model import StepShape
from paged.sim.executor import SimExecutor

QUIET = ["executor=sim", "logger=none", "progress=false"]


def _engine(*overrides: str, executor: SimExecutor | None = None):
    return build_engine(compose_config([*QUIET, "model=opt-13b", *overrides]), executor=executor)


def _blocks(engine) -> int:
    return engine.kv_stats().num_total_blocks


def _executor(*overrides: str, model: str = "opt-13b") -> SimExecutor:
    cfg = compose_config([*QUIET, f"model={model}", *overrides])
    return SimExecutor(cfg.model, cfg.kernel, hardware=cfg.hardware)


def _decode(contexts: list[int]) -> StepShape:
    n = len(contexts)
    return StepShape(num_tokens=n, num_sampled=n, num_seqs=n, decode_contexts=list(contexts))


@pytest.mark.parametrize(("model", "dtype", "ratio"), [("opt-13b", "float16", 2), ("llama-2-7b", "float32", 4)])
def test_an_fp8_block_takes_one_byte_per_element(model, dtype, ratio):
    wide = _executor(f"model.dtype={dtype}", model=model)
    fp8 = _executor(f"model.dtype={dtype}", "kernel.kv_cache_dtype=fp8_e5m2", model=model)
    assert (wide.kv_dtype_bytes, fp8.kv_dtype_bytes) == (ratio, 1)
    assert wide.kv_cache_spec(16).bytes_per_block == ratio * fp8.kv_cache_spec(16).bytes_per_block
    # weights and activations stay at the model's dtype
    assert wide.cost_model.b == fp8.cost_model.b == fp8.dtype_bytes == ratio


def test_the_same_memory_holds_exactly_twice_the_blocks():
    fp16_block = _executor().kv_cache_spec(16).bytes_per_block
    memory = f"allocator.kv_cache_memory={500 * fp16_block}"
    assert _blocks(_engine(memory)) == 500
    assert _blocks(_engine(memory, "kernel.kv_cache_dtype=fp8_e4m3")) == 1000
    # from gpu_memory_utilization the budget is the same bytes (weights and activations unchanged):
    # twice the blocks, plus the half block the fp16 pool could not use
    fp16, fp8 = _blocks(_engine()), _blocks(_engine("kernel.kv_cache_dtype=fp8_e4m3"))
    assert fp8 in (2 * fp16, 2 * fp16 + 1)


def test_a_reused_executor_takes_the_new_engines_kv_dtype():
    executor = _engine().executor
    fp16 = _blocks(_engine(executor=executor))
    assert _blocks(_engine("kernel.kv_cache_dtype=fp8_e4m3", executor=executor)) in (2 * fp16, 2 * fp16 + 1)
    assert executor.kv_dtype_bytes == 1


def test_the_run_describes_the_kv_cache_dtype(caplog):
    with caplog.at_level(logging.INFO):
        engine = _engine("kernel.kv_cache_dtype=fp8_e4m3")
    assert engine.executor.description.endswith("KV cache fp8_e4m3 (1 B/elem)")
    assert "GB of KV cache fp8_e4m3 (1 B/elem) in all" in caplog.text
    assert "KV cache float16 (2 B/elem)" in _engine().executor.description


def test_long_context_decode_is_faster_with_half_the_kv_bytes():
    # Llama-2-7B on an A100-80GB: 32 rows of 1900 tokens read 31 GB of fp16 K/V (it fits the ~58 GB
    # pool), over twice its 13.5 GB of weights
    a100_80 = "hardware=a100-80g"
    fp16 = _executor(a100_80, model="llama-2-7b").cost_model
    fp8 = _executor(a100_80, "kernel.kv_cache_dtype=fp8_e4m3", model="llama-2-7b").cost_model
    long = _decode([1900] * 32)
    slow, fast = fp16.step(long), fp8.step(long)
    assert slow.attention_s > slow.linear_s
    assert fast.linear_s == slow.linear_s
    # K/V reads halve; the queries stay fp16
    assert 0.5 < fast.attention_s / slow.attention_s < 0.51
    assert fast.elementwise_s < slow.elementwise_s  # the cache write stores half the bytes
    assert fast.total_s < 0.8 * slow.total_s
    # short contexts: the weights dominate and fp8 saves little
    short = _decode([128] * 8)
    assert 0.95 < fp8.step(short).total_s / fp16.step(short).total_s < 1


def test_swap_copies_move_half_the_bytes():
    shape = StepShape(num_swap_blocks=64, block_size=16, decode_contexts=[])
    no_latency = "hardware.pcie_latency_s=0"
    fp16 = _executor(no_latency).cost_model.step(shape).swap_s
    assert _executor(no_latency, "kernel.kv_cache_dtype=fp8_e4m3").cost_model.step(shape).swap_s == pytest.approx(
        fp16 / 2
    )
    # the copies (and their fixed latency) stay: one per block, layer and K/V
    with_latency = _executor("kernel.kv_cache_dtype=fp8_e4m3").cost_model
    copies = 2 * 40 * 64
    assert with_latency.step(shape).swap_s == pytest.approx(fp16 / 2 + copies * with_latency.hw.pcie_latency_s)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("kernel.kv_cache_dtype=fp8",
         "kernel.kv_cache_dtype='fp8' is not supported; allowed: auto, float32, bfloat16, fp8_e4m3, fp8_e5m2"),
        ("kernel.kv_cache_dtype=float16", "kernel.kv_cache_dtype='float16' is not supported"),
        ("kernel.k_scale=0", "kernel.k_scale=0.0 must be a finite number > 0"),
        ("kernel.v_scale=-2", "kernel.v_scale=-2.0 must be a finite number > 0"),
        ("kernel.k_scale=nan", "kernel.k_scale=nan must be a finite number > 0"),
        ("kernel.v_scale=inf", "kernel.v_scale=inf must be a finite number > 0"),
    ],
)
def test_bad_kv_cache_settings_name_the_value_and_the_allowed_ones(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_config([override]))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("blocksparse", "message"),
    [
        ({"local_blocks": 2, "vert_stride": 4, "block_size": 40},
         "blocksparse block_size=40 must be a multiple of the KV cache block size 16"),
        ({"local_blocks": 2, "vert_stride": 4}, "kernel.blocksparse needs block_size"),
        ({"local_blocks": 2, "vert_stride": 4, "block_size": 64, "stride": 1},
         "kernel.blocksparse has unknown keys ['stride']; allowed: block_size, head_sliding_step"),
        ({"local_blocks": 0, "vert_stride": 4, "block_size": 64}, "blocksparse local_blocks=0 must be > 0"),
    ],
)
def test_bad_blocksparse_is_a_config_error(blocksparse, message):
    # set on the composed config: Hydra cannot merge a mapping into the schema's null default
    # (omegaconf#1035), so a command line cannot give kernel.blocksparse
    cfg = compose_config()
    cfg.kernel.blocksparse = blocksparse
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value)
    assert str(err.value).startswith("kernel.blocksparse")


def test_valid_kv_cache_settings_pass():
    cfg = compose_config(["kernel.kv_cache_dtype=fp8_e5m2", "kernel.k_scale=0.5", "kernel.v_scale=2"])
    cfg.kernel.blocksparse = {"local_blocks": 2, "vert_stride": 4, "block_size": 64, "head_sliding_step": -1}
    validate(cfg)


def test_block_sparse_decode_reads_only_the_kept_blocks() -> None:
    """Local blocks plus one in vert_stride of the rest: a long context's decode attention reads
    far less, a context inside the local window reads all of it."""
    dense = _executor().cost_model
    sparse = _executor("kernel.blocksparse={local_blocks:4,vert_stride:8,block_size:64}").cost_model
    assert sparse._read(200) == dense._read(200) == 200
    assert sparse._read(4096) == 4 * 64 + (64 - 4) * 64 / 8
    shape = _decode([4096] * 32)
    assert sparse.step(shape).attention_s < 0.3 * dense.step(shape).attention_s
