"""How big the KV cache is when the config does not say, and what `model.dtype=auto` runs in.

The builder's rule (`paged.engine.builder.num_blocks_for`): `allocator.num_blocks`, else
`allocator.kv_cache_memory`, else the executor's share of its device (`kv_cache_budget`), else
`DEFAULT_NUM_BLOCKS` where the executor has none (the real model on a CPU). On CUDA the share is
measured (`paged.executor.memory_profile`); its arithmetic is a pure function, tested here on any
machine, and the measurement on a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

import paged.config.dtype
from paged.config import CONF_DIR, ConfigError, KernelConfig, ModelConfig, compose_config, resolve_dtype, validate
from paged.engine.builder import DEFAULT_NUM_BLOCKS, build_engine, num_blocks_for
from paged.executor.base import Executor, KVCacheSpec
from paged.executor.memory_profile import kv_cache_bytes, measure
from paged.executor.model_executor import ModelExecutor
from paged.sim.calibrate import cache_path
from paged.sim.executor import SimExecutor
from paged.step import ExecutorOutput, SchedulerOutput

QUIET = ["model=tiny-random", "logger=none", "progress=false"]
GiB = 2**30
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)


# -- the arithmetic ---------------------------------------------------------------------------------


def test_the_kv_cache_gets_the_share_less_what_is_in_use_and_the_activation_peak():
    assert kv_cache_bytes(80 * GiB, 0.9, 2 * GiB, GiB) == int(0.9 * 80 * GiB) - 3 * GiB
    assert kv_cache_bytes(1000, 1.0, 0, 0) == 1000


@pytest.mark.parametrize(("used", "peak"), [(72 * GiB, 0), (70 * GiB, 2 * GiB), (80 * GiB, 0)])
def test_nothing_left_is_a_one_line_config_error_naming_the_setting_and_the_numbers(used: int, peak: int):
    with pytest.raises(ConfigError) as err:
        kv_cache_bytes(80 * GiB, 0.9, used, peak)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("allocator.gpu_memory_utilization=0.9 leaves no memory for the KV cache")
    assert "80.00 GiB" in message and "72.00 GiB" in message and f"{used / GiB:.2f} GiB" in message
    assert f"{peak / GiB:.2f} GiB" in message


# -- the builder's rule -----------------------------------------------------------------------------


class Budgeted(Executor):
    """An executor whose device share is `budget` bytes (None: it has no device), blocks 1 KiB."""

    description = "budgeted"

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.asked: list[tuple[float, int, int]] = []

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(block_size, 1024, "1 KiB per block")

    def kv_cache_budget(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int | None:
        self.asked.append((utilization, max_num_batched_tokens, max_num_seqs))
        return self.budget

    def init_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        pass

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        raise NotImplementedError


def _num_blocks(executor: Executor, *overrides: str) -> int:
    cfg = compose_config([*QUIET, *overrides])
    return num_blocks_for(cfg, validate(cfg), executor)


@pytest.mark.parametrize("allocator", sorted(p.stem for p in (CONF_DIR / "allocator").glob("*.yaml")))
def test_no_allocator_preset_fixes_the_number_of_blocks(allocator: str):
    cfg = compose_config([*QUIET, f"allocator={allocator}"])
    assert cfg.allocator.num_blocks is None and cfg.allocator.kv_cache_memory is None


def test_without_a_size_or_a_device_the_cache_gets_the_default_number_of_blocks(caplog):
    executor = Budgeted(None)
    with caplog.at_level(logging.INFO, logger="paged.engine.builder"):
        assert _num_blocks(executor, "scheduler.max_num_seqs=8") == DEFAULT_NUM_BLOCKS == 2048
    assert executor.asked == [(0.9, 4096, 8)]  # the executor was asked first, with the step's limits
    assert "sized by the default of 2048 blocks" in caplog.text


def test_without_a_size_the_executors_device_share_sizes_the_cache(caplog):
    with caplog.at_level(logging.INFO, logger="paged.engine.builder"):
        assert _num_blocks(Budgeted(100 * 1024 + 1023), "allocator.gpu_memory_utilization=0.5") == 100
    assert "sized by allocator.gpu_memory_utilization=0.5" in caplog.text
    with pytest.raises(ConfigError, match="allocator.gpu_memory_utilization=0.9 leaves room for no block"):
        _num_blocks(Budgeted(1023))


@pytest.mark.parametrize(("override", "blocks"), [("allocator.num_blocks=7", 7), ("allocator.kv_cache_memory=8KiB", 8)])
def test_a_size_in_the_config_wins_over_the_device(override: str, blocks: int, caplog):
    executor = Budgeted(None)
    with caplog.at_level(logging.INFO, logger="paged.engine.builder"):
        assert _num_blocks(executor, override) == blocks
    assert executor.asked == []  # not measured at all
    assert f"sized by {override.split('=')[0]}" in caplog.text


def test_the_real_model_on_a_cpu_has_no_device_share_and_gets_the_default():
    engine = build_engine(compose_config([*QUIET, "model.device=cpu"]))
    assert engine.executor.kv_cache_budget(0.9, 4096, 64) is None
    assert engine.scheduler.block_manager.allocator.num_blocks == DEFAULT_NUM_BLOCKS


# -- model.dtype=auto -------------------------------------------------------------------------------


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Set whether this CPU has bf16 arithmetic (AVX512-BF16 or AMX), as `auto` reads it."""
    def set_to(native: bool) -> None:
        monkeypatch.setattr(paged.config.dtype, "bf16_arithmetic_supported", lambda: native)
    return set_to


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_bfloat16_on_cuda_and_on_a_cpu_with_bf16_arithmetic(bf16_cpu, native: bool):
    bf16_cpu(native)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("float16", "cuda") == "float16" and resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("float32", "cpu") == "float32"


def test_the_served_models_default_to_auto_and_the_tiny_ones_stay_float32():
    assert compose_config().model.dtype == "auto"  # smollm2-135m, the default job
    assert compose_config(["model=hf", "model.path=x"]).model.dtype == "auto"
    for tiny in ("tiny-random", "tiny-bloom"):
        assert compose_config([f"model={tiny}"]).model.dtype == "float32"


@pytest.mark.parametrize("native", [False, True])
def test_the_real_model_resolves_auto_on_its_device_and_says_why(bf16_cpu, native: bool):
    bf16_cpu(native)
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", dtype="auto", device="cpu"),
                       KernelConfig(name="t"))
    dtype = torch.bfloat16 if native else torch.float32
    assert ex.dtype == dtype and ex.model.embed.dtype == dtype
    why = "bf16 arithmetic on this CPU" if native else "no bf16 arithmetic on this CPU"
    assert f"({str(dtype)[6:]}, auto: {why})" in ex.description
    named = ModelExecutor(ModelConfig(name="tiny-random", source="random", dtype="float32", device="cpu"),
                          KernelConfig(name="t"))
    assert "(float32)" in named.description


def test_the_simulator_resolves_auto_for_the_hardware_it_simulates(bf16_cpu):
    def sim(*overrides: str) -> SimExecutor:
        cfg = compose_config(["executor=sim", "model=tiny-random", "model.dtype=auto", *overrides])
        return SimExecutor(cfg.model, cfg.kernel, hardware=cfg.hardware)

    bf16_cpu(False)
    gpu = sim("hardware=a100-40g")
    assert (gpu.dtype_name, gpu.dtype_bytes, gpu.kv_cache_dtype) == ("bfloat16", 2, "bfloat16")
    assert "(bfloat16) simulated" in gpu.description
    # a calibrated hardware is this machine's CPU (cpu-local), where the real model runs as `auto` says there
    assert sim("hardware=a100-40g", "hardware.calibrated=true").dtype_name == "float32"
    assert sim("hardware=a100-40g", "model.dtype=float16").dtype_name == "float16"
    bf16_cpu(True)
    assert sim("hardware=a100-40g", "hardware.calibrated=true").dtype_name == "bfloat16"


@pytest.mark.parametrize("native", [False, True])
def test_auto_on_cpu_local_reuses_the_calibration_of_the_dtype_it_resolves_to(bf16_cpu, native: bool):
    bf16_cpu(native)

    def path(dtype: str) -> str:
        return cache_path(compose_config(["executor=sim", "hardware=cpu-local", "model=tiny-random",
                                          f"model.dtype={dtype}"])).name

    resolved = "bfloat16" if native else "float32"
    assert path("auto") == path(resolved) and f"-{resolved}-" in path("auto")


# -- on a GPU -------------------------------------------------------------------------------------


@needs_cuda
def test_on_cuda_auto_runs_bfloat16():
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", dtype="auto", device="cuda"),
                       KernelConfig(name="t"))
    assert ex.dtype == torch.bfloat16


@needs_cuda
def test_on_cuda_the_cache_takes_the_measured_share_and_a_reused_executor_gets_it_again():
    cfg = compose_config([*QUIET, "model.device=cuda", "scheduler.max_num_batched_tokens=1024",
                          "scheduler.max_num_seqs=16"])
    engine = build_engine(cfg)
    ex = engine.executor
    total = torch.cuda.mem_get_info(ex.device)[1]
    bytes_per_block = ex.kv_cache_spec(cfg.allocator.block_size).bytes_per_block
    num_blocks = engine.scheduler.block_manager.allocator.num_blocks
    cache_bytes = num_blocks * bytes_per_block
    # most of 0.9 of the GPU (the tiny model's weights and activations are small), never more
    assert 0.5 * total < cache_bytes <= 0.9 * total
    assert sum(t.nbytes for t in ex.key_caches + ex.value_caches) == cache_bytes
    # the executor's own cache, about to be replaced, does not count as in use
    again = build_engine(cfg, executor=ex)
    assert again.scheduler.block_manager.allocator.num_blocks == pytest.approx(num_blocks, rel=0.02)


@needs_cuda
def test_on_cuda_the_activation_peak_grows_with_the_step():
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cuda"), KernelConfig(name="t"))
    small = measure(ex.model, ex.device, 256, 4, ex.arch.max_position_embeddings)
    large = measure(ex.model, ex.device, 4096, 4, ex.arch.max_position_embeddings)
    assert 0 < small.activation_peak < large.activation_peak
    assert small.total == large.total and 0 < small.used_after_load < small.total


@needs_cuda
def test_on_cuda_too_small_a_share_is_a_config_error():
    cfg = compose_config([*QUIET, "model.device=cuda", "allocator.gpu_memory_utilization=0.001"])
    with pytest.raises(ConfigError, match="allocator.gpu_memory_utilization=0.001 leaves no memory"):
        build_engine(cfg)
