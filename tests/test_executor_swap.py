"""Swap space in ModelExecutor: KV blocks swapped out to host memory, wiped on the device and swapped
back into other device blocks decode exactly as if they had never moved, on every kernel backend;
first driven by hand-built SchedulerOutputs, then by the engine's swap preemption."""

from __future__ import annotations

import functools

import pytest
import torch

from paged import LLM, SamplingParams, kernels
from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.request import Request
from paged.step import ScheduledSeq, SchedulerOutput
from tests.test_executor import BLOCK, step

pytestmark = pytest.mark.compiles

PROMPT = list(range(100, 137))  # three blocks, the last partly filled
DECODE_STEPS = 4


def require(backend: str) -> str:
    """The device the backend's tensors live on; skips where it cannot run."""
    reason = kernels.get_backend(backend).unavailable_reason()
    if reason:
        pytest.skip(f"backend={backend} unavailable: {reason}")
    return "cuda" if backend == "cuda" else "cpu"


def swap_executor(backend: str, num_blocks: int = 32, num_cpu_blocks: int = 8) -> ModelExecutor:
    ex = ModelExecutor(
        ModelConfig(name="tiny-random", source="random", device=require(backend)),
        KernelConfig(name="test", version="v1", backend=backend),
    )
    ex.init_kv_cache(num_blocks=num_blocks, block_size=BLOCK, num_cpu_blocks=num_cpu_blocks)
    return ex


def caches(ex: ModelExecutor) -> list[torch.Tensor]:
    return [*ex.key_caches, *ex.value_caches]


def cpu_caches(ex: ModelExecutor) -> list[torch.Tensor]:
    return [*ex.cpu_key_caches, *ex.cpu_value_caches]


def decode_logits(ex: ModelExecutor, seq, table: list[int], monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The logits of `DECODE_STEPS` greedy decode steps of `seq` over `table`."""
    logits: list[torch.Tensor] = []
    compute_logits = ex.model.compute_logits

    def recorded_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits.append(compute_logits(hidden))
        return logits[-1]

    with monkeypatch.context() as m:
        m.setattr(ex.model, "compute_logits", recorded_logits)
        for _ in range(DECODE_STEPS):
            step(ex, [ScheduledSeq(seq, 1, table)], prefill=False)
    return logits


def prefilled(ex: ModelExecutor, request_id: str, table: list[int]):
    seq = Request(request_id, PROMPT, SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0)).seqs[0]
    step(ex, [ScheduledSeq(seq, seq.num_tokens, table)], prefill=True)
    return seq


def test_swap_space_has_the_device_layout_in_host_memory() -> None:
    ex = swap_executor("torch", num_blocks=32, num_cpu_blocks=8)
    assert len(ex.cpu_key_caches) == len(ex.cpu_value_caches) == ex.arch.num_layers
    for device, host in zip(caches(ex), cpu_caches(ex), strict=True):
        assert host.shape == (8, *device.shape[1:]) and host.dtype == device.dtype
        assert host.device.type == "cpu"
    ex.init_kv_cache(num_blocks=32, block_size=BLOCK)
    assert all(c.shape[0] == 0 for c in cpu_caches(ex))


@pytest.mark.parametrize("backend", ["torch", "cpu", "emu", "cuda"])
def test_blocks_swapped_out_and_back_in_elsewhere_decode_as_if_never_moved(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = swap_executor(backend)
    if ex.device.type == "cuda":
        assert all(c.is_pinned() for c in cpu_caches(ex))
    unswapped = prefilled(ex, "a", [0, 1, 2])
    expected = decode_logits(ex, unswapped, [0, 1, 2], monkeypatch)

    seq = prefilled(ex, "b", [3, 4, 5])
    out = ex.execute(SchedulerOutput(blocks_to_swap_out=[(3, 6), (4, 0), (5, 2)]))
    assert out.sampled == []
    for cache in caches(ex):
        cache[3:6] = 0  # the device blocks go to other sequences
    ex.execute(SchedulerOutput(blocks_to_swap_in=[(6, 10), (0, 11), (2, 12)]))
    got = decode_logits(ex, seq, [10, 11, 12], monkeypatch)

    assert seq.output_token_ids == unswapped.output_token_ids
    for ours, ref in zip(got, expected, strict=True):
        assert torch.equal(ours, ref)


def test_swaps_run_out_then_in_then_copies_before_the_step_computes() -> None:
    ex = swap_executor("torch", num_blocks=8, num_cpu_blocks=4)
    for i, cache in enumerate(caches(ex)):
        for block in range(8):
            cache[block] = 10 * i + block
    for cache in cpu_caches(ex):
        cache[1] = -1.0
    # A prefill in block 5 (its table) after block 3 went out, CPU block 1 came into 3, 3 was copied to 4.
    seq = Request("p", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0)).seqs[0]
    ex.execute(SchedulerOutput(
        [ScheduledSeq(seq, 3, [5])], is_prefill=True,
        blocks_to_swap_out=[(3, 0)], blocks_to_swap_in=[(1, 3)], blocks_to_copy=[(3, 4)],
    ))
    for i, (device, host) in enumerate(zip(caches(ex), cpu_caches(ex), strict=True)):
        assert (host[0] == 10 * i + 3).all()
        assert (device[3] == -1).all() and (device[4] == -1).all()


SWAP_PROMPTS = [[(37 * n + 11 * i) % 40000 for i in range(n)] for n in (30, 45, 20, 50)]
SWAP_PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


@functools.cache
def uncontended(window: str) -> list[list[int]]:
    """The outputs with room for every sequence, on the torch reference backend."""
    llm = LLM("tiny-random", allocator="naive",
              overrides=["model.device=cpu", "kernel.backend=torch", f"model.sliding_window={window}"])
    return [o.token_ids for o in llm.generate(SWAP_PROMPTS, SWAP_PARAMS)]


# The four sequences never fit at once: with a window the block manager frees the blocks behind
# it, so fewer blocks are needed to force swaps.
@pytest.mark.parametrize(("window", "num_blocks"), [("null", 8), ("16", 5)], ids=["full", "sliding-window"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "emu", "cuda"])
def test_swap_preemption_generates_what_an_uncontended_cache_does(
    backend: str, window: str, num_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = [f"model.device={require(backend)}", f"kernel.backend={backend}", f"model.sliding_window={window}"]
    swaps = []
    swap_blocks = kernels.swap_blocks

    def counted_swap_blocks(src, dst, mapping, **kw) -> None:
        swaps.append(mapping)
        swap_blocks(src, dst, mapping, **kw)

    monkeypatch.setattr(kernels, "swap_blocks", counted_swap_blocks)
    tight = LLM("tiny-random", allocator="naive", overrides=[
        *overrides, f"allocator.num_blocks={num_blocks}", "scheduler.preemption_mode=swap",
        "allocator.swap_space=1MiB",
    ]).generate(SWAP_PROMPTS, SWAP_PARAMS)
    assert swaps, "the cache must be tight enough to swap"
    assert [o.token_ids for o in tight] == uncontended(window)
