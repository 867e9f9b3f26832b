"""A step planned once: no host read of a tensor value in a decode or mixed step's forward, kernel
inputs checked once per step (not per layer), and the padded decode batch a CUDA graph replays
giving the eager step's output, on every CPU backend (emu runs the CUDA kernels' sources)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from paged.config import ConfigError, KernelConfig, ModelConfig, compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import drive
from paged.executor.cuda_graphs import capture_sizes, padded_size
from paged.executor.model_executor import ModelExecutor
from paged.executor.step_plan import InputBuffers, pad_decode, plan_batch
from paged.experiment.summary import summarize
from paged.kernels import input_checks, step_checks
from paged.kernels.toolchain import host_compiler
from paged.request import Request, SamplingParams
from paged.step import ScheduledSeq, SchedulerOutput

BLOCK = 16
# what reading a tensor's value on the host looks like from Python
HOST_READS = frozenset({"item", "tolist", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy"})

_NO_COMPILER = host_compiler.unavailable_reason()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
BACKENDS = ["torch", pytest.param("cpu", marks=needs_compiler), pytest.param("emu", marks=needs_compiler)]


class HostReads(TorchFunctionMode):
    """Records every host read of a tensor value made through torch's Python API."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def make_executor(backend: str, kv_cache_dtype: str = "auto", **arch: Any) -> ModelExecutor:
    ex = ModelExecutor(
        ModelConfig(name="tiny-random", source="random", dtype="float32", arch=arch),
        KernelConfig(name="t", version="auto", backend=backend, partition_size=32, kv_cache_dtype=kv_cache_dtype),
    )
    ex.init_kv_cache(num_blocks=64, block_size=BLOCK)
    return ex


class Steps:
    """Three sequences through prefill, decode and a mixed step, applied as the engine would."""

    def __init__(self, ex: ModelExecutor) -> None:
        self.ex = ex
        params = SamplingParams(max_tokens=8, temperature=0.0)
        self.seqs = [Request(str(i), list(range(10, 10 + n)), params).seqs[0] for i, n in enumerate((20, 5, 40))]
        self.tables = [[0, 1], [2], [3, 4, 5]]

    def run(self, items: list[ScheduledSeq]) -> list[list[int]]:
        out = self.ex.execute(SchedulerOutput(items, is_prefill=any(not it.is_decode for it in items)))
        for it, tokens in zip(items, out.sampled, strict=True):
            it.seq.num_computed_tokens += it.num_new_tokens
            it.seq.token_ids.extend(tokens[:1])
        return out.sampled

    def prefill(self, which: list[int]) -> list[list[int]]:
        return self.run([ScheduledSeq(self.seqs[i], self.seqs[i].num_tokens - self.seqs[i].num_computed_tokens,
                                      self.tables[i]) for i in which])

    def decode(self, which: list[int]) -> list[list[int]]:
        return self.run([ScheduledSeq(self.seqs[i], 1, self.tables[i]) for i in which])

    def mixed(self) -> list[list[int]]:
        return self.run([ScheduledSeq(self.seqs[0], 1, self.tables[0]), ScheduledSeq(self.seqs[1], 1, self.tables[1]),
                         ScheduledSeq(self.seqs[2], self.seqs[2].num_tokens, self.tables[2])])


@contextmanager
def forward_reads(ex: ModelExecutor) -> Iterator[list[collections.Counter[str]]]:
    """The host reads of each model forward run inside the block."""
    counts: list[collections.Counter[str]] = []
    forward = ex.model.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        with HostReads() as mode:
            out = forward(*args, **kwargs)
        counts.append(mode.reads)
        return out

    ex.model.forward = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        ex.model.forward = forward  # type: ignore[method-assign]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_and_mixed_forward_host_sync_free(backend: str, kv_cache_dtype: str) -> None:
    steps = Steps(make_executor(backend, kv_cache_dtype))
    steps.prefill([0, 1])
    with forward_reads(steps.ex) as counts:
        steps.decode([0, 1])
        steps.mixed()
    assert counts == [collections.Counter(), collections.Counter()], f"host reads in decode, mixed: {counts}"


def test_the_counter_sees_host_reads() -> None:
    """The mode the host_sync tests trust does record each kind of read."""
    t = torch.arange(4)
    with HostReads() as mode:
        int(t[1]), bool(t[2]), float(t[3]), t.tolist(), t[0].item(), t.cpu(), t.numpy()
    assert set(mode.reads) == {"__int__", "__bool__", "__float__", "tolist", "item", "cpu", "numpy"}


CHECKS = [(input_checks, "check_paged_attention"), (input_checks, "check_prefill_attention"),
          (input_checks, "check_reshape_and_cache"), (step_checks, "check_rows"), (step_checks, "check_slots")]


def test_kernel_inputs_checked_once_per_step_not_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = Steps(make_executor("torch", num_layers=4))
    calls: collections.Counter[str] = collections.Counter()
    for module, name in CHECKS:
        check = getattr(module, name)

        def counted(*args: Any, _check: Callable = check, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _check(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    steps.prefill([0, 1])
    assert calls == {"check_prefill_attention": 1, "check_reshape_and_cache": 1, "check_rows": 1, "check_slots": 1}
    calls.clear()
    steps.decode([0, 1])
    assert calls == {"check_paged_attention": 1, "check_reshape_and_cache": 1, "check_rows": 1, "check_slots": 1}
    calls.clear()
    steps.mixed()  # decode rows and prefill rows: one check of each op's rows
    assert calls == {"check_paged_attention": 1, "check_prefill_attention": 1, "check_reshape_and_cache": 1,
                     "check_rows": 2, "check_slots": 1}


def test_bad_rows_are_refused_on_the_host_before_any_kernel() -> None:
    steps = Steps(make_executor("torch"))
    steps.tables[1] = [99]  # the cache has 64 blocks of 16 slots
    with pytest.raises(ValueError, match=r"slot_mapping holds \[1584, .*\]; slots run from 0 to 1023"):
        steps.prefill([1])
    tables, lens, offsets = np.array([[3, 99]], dtype=np.int32), np.array([20], dtype=np.int32), np.array([0, 1])
    with pytest.raises(ValueError, match=r"block_tables name block\(s\) \[99\] outside the cache's 64 blocks"):
        step_checks.check_rows(tables, lens, offsets, num_tokens=1, block_size=BLOCK, num_blocks=64, max_seq_len=20)
    step_checks.check_rows(tables, np.array([16], dtype=np.int32), offsets, num_tokens=1, block_size=BLOCK,
                           num_blocks=64, max_seq_len=16)  # a column past the context is never read
    with pytest.raises(ValueError, match=r"a sequence has more queries than context"):
        step_checks.check_rows(tables, lens, np.array([0, 21]), num_tokens=21, block_size=BLOCK, num_blocks=100,
                               max_seq_len=20)
    with pytest.raises(ValueError, match=r"max_seq_len=19 is below the longest sequence \(20\)"):
        step_checks.check_rows(tables, lens, offsets, num_tokens=1, block_size=BLOCK, num_blocks=100, max_seq_len=19)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_padded_decode_batch_gives_the_eager_rows(backend: str, version: str) -> None:
    """What a CUDA graph replays: rows padded to a capture size, tables as wide as max_model_len,
    kernels launched for the longest context. The real rows' hidden states are the eager step's
    bit for bit, and padding rows write nothing to the cache."""
    ex = make_executor(backend)
    steps = Steps(ex)
    steps.prefill([0, 1, 2])
    sched = SchedulerOutput([ScheduledSeq(steps.seqs[i], 1, steps.tables[i]) for i in (0, 1, 2)])
    host = plan_batch(sched, BLOCK)
    buffers = InputBuffers(torch.device("cpu"))
    caches = [c.clone() for c in (*ex.key_caches, *ex.value_caches)]
    with torch.inference_mode():
        eager = ex._forward(buffers.upload(host), version).clone()
        for c, before in zip((*ex.key_caches, *ex.value_caches), caches, strict=True):
            c.copy_(before)
        padded = ex._forward(buffers.upload(pad_decode(host, 8, 32, 32 * BLOCK)), version)
    assert torch.equal(padded[:3], eager)
    written = [not torch.equal(c, before) for c, before in zip((*ex.key_caches, *ex.value_caches), caches)]
    assert all(written), "each layer's cache gets the real rows' K/V"
    blocks_untouched = [c[6:].eq(0).all().item() for c in ex.value_caches]
    assert all(blocks_untouched), "padding rows (slot -1) write nothing"


def test_pad_decode_shapes() -> None:
    seqs = [Request(str(i), list(range(n)), SamplingParams(max_tokens=2)).seqs[0] for i, n in enumerate((3, 20))]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    host = plan_batch(SchedulerOutput([ScheduledSeq(seqs[0], 1, [4]), ScheduledSeq(seqs[1], 1, [5, 6])]), BLOCK)
    padded = pad_decode(host, 4, 8, 128)
    assert padded.slot_mapping.tolist() == [4 * BLOCK + 2, 6 * BLOCK + 3, -1, -1]
    assert padded.decode is not None and padded.decode.block_tables.shape == (4, 8)
    assert padded.decode.seq_lens.tolist() == [3, 20, 1, 1]
    assert padded.decode.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.decode.max_seq_len == 128
    assert padded.sample_rows.tolist() == [0, 1]
    np.testing.assert_array_equal(padded.decode.block_tables[:2, :2], [[4, 0], [5, 6]])


def test_capture_sizes_follow_vllm() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(1) == [1]
    assert capture_sizes(5000)[-1] == 512
    assert [padded_size(n, capture_sizes(20)) for n in (1, 3, 5, 9, 17, 24, 25)] == [1, 4, 8, 16, 24, 24, None]


def test_cuda_graphs_on_a_cpu_model_is_a_config_error_before_weights_load() -> None:
    with pytest.raises(ConfigError, match=r"executor.cuda_graphs=true needs a CUDA device, but the model runs on cpu"):
        ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"),
                      KernelConfig(name="t"), cuda_graphs=True)


class _PastTheChecks(Exception):
    """Raised where the executor, its config checked, starts to build the model."""


@pytest.mark.parametrize("size", [1, 2])
def test_cuda_graphs_with_a_random_model_is_refused_only_with_tensor_parallelism(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensor-parallel refusal sat inside the checks every random or HF model runs at size 1 too,
    so `executor.cuda_graphs=true` refused a single-GPU `model=tiny-random` (3 graph tests failed on an
    H200). A CUDA device is pretended: the checks end before anything touches it."""
    import paged.executor.model_executor as model_executor

    def past_the_checks(*args: Any, **kwargs: Any) -> None:
        raise _PastTheChecks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(model_executor.threads, "configure", past_the_checks)
    config = ModelConfig(name="tiny-random", source="random", device="auto")
    expected = _PastTheChecks if size == 1 else ConfigError
    with pytest.raises(expected, match=None if size == 1 else "cuda_graphs=true does not run with executor.tensor"):
        ModelExecutor(config, KernelConfig(name="t", backend="torch"), cuda_graphs=True, tensor_parallel_size=size)


def test_summary_counts_graph_eager_decode_and_eager_mixed_steps() -> None:
    cfg = compose_config(["model=tiny-random", "logger=none", "progress=false", "executor.cuda_graphs=null",
                          "model.device=cpu"])
    engine = build_engine(cfg)
    for i in range(3):
        engine.add_request(Request(str(i), list(range(5 + i)), SamplingParams(max_tokens=4, temperature=0.0)))
    drive(engine)
    summary = summarize(cfg, engine)
    assert summary["cuda_graph_steps"] == 0
    assert summary["eager_decode_steps"] == 3  # one prefill step, then three decode steps
    assert summary["eager_mixed_steps"] == 1
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        build_engine(compose_config(["model=tiny-random", "logger=none", "executor.cuda_graphs=true",
                                     "model.device=cpu"]))
