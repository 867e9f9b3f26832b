"""Tensor parallelism in the real executor (issue 31). Shards reduced together compute the whole
model, with KV heads split or replicated; tiny-random over 2 ranks (one query head each, its one KV
head replicated) generates the unsplit model's greedy tokens, beam search included, under prefix
caching and swap preemption, on every CPU kernel backend, and leaks no block; a size that does not
divide the heads is one line before any weights load; a worker that fails or dies, or rank 0
interrupted mid-step, is one error, not a hang, and workers never outlive their driver. SmolLM2 over
3 ranks (9 heads, 3 KV heads) is a slow test, as is the emu backend."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from paged import LLM, SamplingParams
from paged.config import ConfigError, KernelConfig, ModelConfig, compose_config
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.runner import drive
from paged.executor.model_executor import ModelExecutor
from paged.executor.tp_workers import TensorParallelError
from paged.kernels.toolchain import host_compiler
from paged.model.arch import LlamaArch
from paged.model.llama import LlamaModel
from paged.model.locate import INSTALL_HINT, locate_smollm2
from paged.model.tensor_parallel import shard_arch, shard_state, tensor_parallel_sizes
from paged.model.tiny import random_state, tiny_arch
from paged.request import FinishReason, Request

pytestmark = pytest.mark.subprocess

_NO_COMPILER = host_compiler.unavailable_reason()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
# emu runs every CUDA thread as a host thread: about 100 s for this test on 2 cores
BACKENDS = ["torch", pytest.param("cpu", marks=needs_compiler),
            pytest.param("emu", marks=[needs_compiler, pytest.mark.slow])]

# 24 blocks of 16 tokens hold about a third of the workload at once: requests are swapped out and back
TIGHT = ("allocator=prefix", "scheduler.preemption_mode=swap", "allocator.swap_space=2MiB", "allocator.num_blocks=24",
         "allocator.block_size=16", "scheduler.max_model_len=128", "scheduler.max_num_batched_tokens=128")


def tiny_executor(size: int) -> ModelExecutor:
    return ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"),
                         KernelConfig(name="t", version="auto", backend="torch"), tensor_parallel_size=size)


@pytest.fixture(scope="module")
def whole() -> ModelExecutor:
    return tiny_executor(1)


@pytest.fixture(scope="module")
def split() -> Iterator[ModelExecutor]:
    ex = tiny_executor(2)
    yield ex
    ex.shutdown()


def engine_for(ex: ModelExecutor, *overrides: str) -> Engine:
    return build_engine(compose_config(["model=tiny-random", "logger=none", "progress=false", *overrides]), executor=ex)


def workload() -> list[Request]:
    """Three shared 32-token prefixes with their own tails, greedy and beam search (width 2)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(3)]
    requests = []
    for i in range(12):
        prompt = prefixes[i % 3] + [rng.randrange(1000, 40000) for _ in range(rng.randint(4, 20))]
        beam = i % 4 == 3
        params = SamplingParams(max_tokens=rng.randint(8, 40), temperature=0.0, ignore_eos=True,
                                n=2 if beam else 1, use_beam_search=beam)
        requests.append(Request(f"r{i}", prompt, params, arrival_time=0.0))
    return requests


def run(engine: Engine) -> list[list[list[int]]]:
    """Each request's completions (a beam search's hypotheses), after every request finished."""
    requests = workload()
    for r in requests:
        engine.add_request(r)
    drive(engine)
    assert all(c.finish_reason is FinishReason.LENGTH for r in requests for c in r.outputs())
    return [[c.token_ids for c in r.outputs()] for r in requests]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_generate_the_whole_models_tokens(whole, split, backend) -> None:
    overrides = (*TIGHT, f"kernel.backend={backend}")
    expected = run(engine_for(whole, *overrides))
    engine = engine_for(split, *overrides)
    assert run(engine) == expected
    stats, counters = engine.kv_stats(), engine.counters
    assert counters.num_swaps_out > 0 and counters.num_swaps_in == counters.num_swaps_out
    assert stats.num_hit_tokens > 0
    assert stats.num_allocated_blocks == 0 and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert split.key_caches[0].shape[1] == split.shard.num_kv_heads == 1 and split.shard.num_heads == 1


def test_a_block_costs_every_ranks_share_and_the_swap_pool_is_per_rank(whole, split) -> None:
    assert split.kv_cache_spec(16).bytes_per_block == 2 * whole.kv_cache_spec(16).bytes_per_block
    assert split.num_devices == 2 and "tensor parallel over 2 ranks" in split.description
    engine = engine_for(split, *TIGHT)
    # 2 MiB per rank of 16 KiB blocks on each rank
    assert engine.kv_stats().num_cpu_blocks == 128


def test_the_sizes_that_split_the_heads() -> None:
    smollm2 = LlamaArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                        num_kv_heads=3, head_dim=64)
    assert tensor_parallel_sizes(smollm2) == [1, 3]
    assert tensor_parallel_sizes(tiny_arch()) == [1, 2]
    assert tensor_parallel_sizes(tiny_arch({"num_heads": 8, "num_kv_heads": 4})) == [1, 2, 4, 8]


class ThreadSum:
    """An all-reduce among `size` threads of this process, summing in rank order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: list[torch.Tensor | None] = [None] * size

    def of(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            x.copy_(sum(self.parts))
            self.barrier.wait()  # nobody writes the next layer's part before all have read this one's
            return x

        return reduce


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence's attention without a cache, KV heads shared by their query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 2, 2), (4, 2, 4), (4, 4, 2), (2, 1, 2)])
def test_shards_reduced_together_compute_the_whole_model(heads, kv_heads, size) -> None:
    arch = tiny_arch({"num_heads": heads, "num_kv_heads": kv_heads, "qkv_bias": True, "num_layers": 2})
    state = random_state(arch)
    tokens, positions = torch.tensor([5, 900, 41, 7000, 12, 3]), torch.arange(6)
    expected = LlamaModel(arch, state).forward(tokens, positions, causal_attention)
    total = ThreadSum(size)
    shards = [LlamaModel(shard_arch(arch, size), shard_state(arch, state, rank, size), all_reduce=total.of(rank))
              for rank in range(size)]
    with ThreadPoolExecutor(size) as pool:
        hidden = list(pool.map(lambda m: m.forward(tokens, positions, causal_attention), shards))
    assert shards[0].arch.num_heads == heads // size and shards[0].arch.num_kv_heads == max(1, kv_heads // size)
    for h in hidden:
        torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("weights were loaded before the config error")

    monkeypatch.setattr("paged.executor.model_executor.load_weights", refuse)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["executor.tensor_parallel_size=3"], "executor.tensor_parallel_size=3 does not divide tiny-random's 2 "
         "attention heads (1 KV head); allowed: 1, 2"),
        (["executor.tensor_parallel_size=0"], "executor.tensor_parallel_size=0 must be a positive integer"),
        (["model=tiny-bloom", "executor.tensor_parallel_size=2"], "tiny-bloom is a bloom model"),
    ],
)
def test_a_size_that_cannot_split_the_model_is_one_line_before_weights_load(no_weights, overrides, message) -> None:
    with pytest.raises(ConfigError) as err:
        LLM("tiny-random", overrides=overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_worker_that_raises_is_one_error_and_the_executor_refuses_further_steps() -> None:
    ex = tiny_executor(2)
    engine = engine_for(ex)
    ex.workers.send("compile_everything", reply=True)
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: ValueError: tensor-parallel worker cannot run "):
        ex.workers.replies()
    assert not any(p.is_alive() for p in ex.workers.processes)
    engine.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)))
    with pytest.raises(TensorParallelError, match="stopped after an error: rank 1 failed"):
        drive(engine)


def test_rank_0_interrupted_mid_step_stops_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = tiny_executor(2)
    engine = engine_for(ex)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    engine.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)))
    monkeypatch.setattr(ex.model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    # the worker was left in the step's first all-reduce, which rank 0 never reached
    assert not any(p.is_alive() for p in ex.workers.processes)
    monkeypatch.undo()
    with pytest.raises(TensorParallelError, match="stopped after an error: rank 0 failed: KeyboardInterrupt"):
        engine.step()


@pytest.mark.serial("asserts the error within 30 s of a kill, with three processes of its own")
def test_a_worker_killed_mid_run_is_one_error_not_a_hang() -> None:
    ex = tiny_executor(2)
    engine = engine_for(ex)
    engine.add_request(Request("r", list(range(100, 140)), SamplingParams(max_tokens=50, temperature=0.0)))
    engine.step()
    os.kill(ex.workers.processes[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 exited with code -9"):
        drive(engine)
    assert time.monotonic() - start < 30


DRIVER = """
import gc, os
from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor


def build():
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"),
                       KernelConfig(name="t", version="auto", backend="torch"), tensor_parallel_size=2)
    print(ex.workers.processes[0].pid, flush=True)
    return ex


if __name__ == "__main__":
    dropped = build()
    worker = dropped.workers.processes[0]
    del dropped
    gc.collect()
    print(worker.exitcode, flush=True)  # the finalizer joined it
    kept = build()
    os.kill(os.getpid(), 9)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_workers_exit_when_their_executor_is_collected_or_their_driver_killed() -> None:
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    first, exitcode, second = done.stdout.split()
    assert exitcode == "0" and done.returncode == -signal.SIGKILL, done.stderr
    pids = [int(first), int(second)]
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_smollm2_over_three_ranks_generates_its_greedy_tokens() -> None:
    try:
        locate_smollm2()
    except FileNotFoundError:
        pytest.skip(f"SmolLM2 weights not installed ({INSTALL_HINT})")
    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(16)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # float32 pinned: `auto` is bfloat16 on a CPU with bf16 arithmetic, where near-ties flip more often
    expected = [o.outputs[0].token_ids for o in LLM("smollm2-135m", dtype="float32").generate(
        prompts, greedy, use_tqdm=False)]
    llm = LLM("smollm2-135m", dtype="float32", tensor_parallel_size=3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    # the all-reduces sum in another order than one matmul: a near-tie may flip (issue 31 allows 2 in 32)
    assert same >= len(prompts) - 1, [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert llm.engine.kv_stats().num_allocated_blocks == 0
    llm.executor.shutdown()
