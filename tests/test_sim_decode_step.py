"""`CostModel.decode_step` (fast-forward's cost of a decode-only step) is `CostModel.step` of that
step to the bit, whatever the model, GPUs, kernel version, block size or block-sparse pattern, and
on the batch size's second step (its parts cached) as on its first; `step_costs` (a window's
steps, many a call) is `decode_step` of each step to the bit."""

from __future__ import annotations

import random

import pytest

from paged.config import compose_config
from paged.kernels.features import BlockSparse
from paged.sim.cost_model import CostModel, StepShape
from paged.sim.decode_steps import StepSums, step_costs
from paged.sim.executor import SimExecutor
from paged.sim.hardware import resolve_hardware

QUIET = ["logger=none", "progress=false"]


def _model(model: str, hardware: str, num_gpus: int, version: str, blocksparse: BlockSparse | None) -> CostModel:
    cfg = compose_config(["executor=sim", *QUIET, f"model={model}", f"hardware={hardware}",
                          f"hardware.num_gpus={num_gpus}"])
    spec = SimExecutor(cfg.model, cfg.kernel, hardware=cfg.hardware).spec
    return CostModel(spec, resolve_hardware(cfg.hardware), 2, version=version, blocksparse=blocksparse)


@pytest.mark.parametrize(("model", "hardware", "num_gpus", "version", "sparse"), [
    ("llama-2-7b", "a100-80g", 1, "auto", False),
    ("llama-3-8b", "h100-sxm", 1, "v1", False),
    ("llama-3-70b", "h100-sxm", 4, "v2", False),
    ("opt-13b", "a100-40g", 2, "v3", False),
    ("llama-2-7b", "a100-80g", 1, "auto", True),
])
def test_decode_step_is_step_to_the_bit(model, hardware, num_gpus, version, sparse):
    blocksparse = BlockSparse(local_blocks=4, vert_stride=8, block_size=16) if sparse else None
    cost_model = _model(model, hardware, num_gpus, version, blocksparse)
    rng = random.Random(45)
    versions = set()
    for block_size in (16, 32):
        for n in (1, 2, 5, 64, 256):
            for _ in range(2):  # the second of a size reads its cached parts
                contexts = [rng.randint(1, 16384 if n < 8 else 2048) for _ in range(n)]
                shape = StepShape(n, n, n, decode_contexts=list(contexts), block_size=block_size)
                expected = cost_model.step(shape)
                got = cost_model.decode_step(contexts, block_size)
                assert got == expected and repr(got) == repr(expected)
                versions.add(got.decode_version)
    if version != "auto":
        assert versions == {version}


@pytest.mark.parametrize(("model", "hardware", "num_gpus", "version", "sparse"), [
    ("llama-2-7b", "a100-80g", 1, "auto", False),
    ("llama-3-8b", "h100-sxm", 1, "v1", False),
    ("llama-3-70b", "h100-sxm", 4, "v2", False),
    ("opt-13b", "a100-40g", 2, "v3", False),
    ("llama-3-8b", "h100-sxm", 1, "vllm", False),
    ("llama-2-7b", "a100-80g", 1, "auto", True),
])
def test_step_costs_are_decode_step_to_the_bit(model, hardware, num_gpus, version, sparse):
    """k steps of `step_costs` (small batches summed per step, large ones with kept sums; the
    second pass over the same sizes from its kept plans) are k calls of `decode_step`: each end the
    clock's additions of their totals, each model time and version, and the last step's cost."""
    blocksparse = BlockSparse(local_blocks=4, vert_stride=8, block_size=16) if sparse else None
    cost_model = _model(model, hardware, num_gpus, version, blocksparse)
    rng = random.Random(46)
    versions = set()
    for block_size in (16, 32):
        for n in (1, 3, 8, 15, 16, 64):
            # contexts across partition and split edges, and past the lengths where v3's split changes
            contexts = [rng.randint(1, 9000 if n < 8 else 1500) for _ in range(n)]
            start = rng.uniform(0.0, 100.0)
            for _ in range(2):
                got = step_costs(cost_model, StepSums(contexts), 0, block_size, 600, start, float("inf"))
                assert len(got.ends) == 600
                t = start
                for j in range(600):
                    expected = cost_model.decode_step([c + j for c in contexts], block_size)
                    t += expected.total_s
                    assert got.ends[j] == t, (n, j)
                    assert got.model_times[j] == expected.total_s - expected.overhead_s, (n, j)
                    assert got.versions[j] == expected.decode_version, (n, j)
                    versions.add(expected.decode_version)
                last = got.last_cost(cost_model)
                assert last == expected and repr(last) == repr(expected)
    if version == "vllm":
        assert versions == {"v1", "v2"}  # the rule's choice changes along the way
    elif version != "auto":
        assert versions == {version}


def test_step_costs_stop_at_the_horizon():
    """The first step always runs; a later one only if it starts (the previous one's end) before `until`."""
    cost_model = _model("llama-3-8b", "h100-sxm", 1, "auto", None)
    contexts = [100, 2000, 37]
    every = step_costs(cost_model, StepSums(contexts), 0, 16, 50, 1.0, float("inf"))
    until = every.ends[6]
    cut = step_costs(cost_model, StepSums(contexts), 0, 16, 50, 1.0, until)
    assert cut.ends == every.ends[:7] and cut.ends[-1] >= until > cut.ends[-2]
    assert step_costs(cost_model, StepSums(contexts), 0, 16, 50, 1.0, 0.0).ends == every.ends[:1]
    assert step_costs(cost_model, StepSums(contexts), 0, 16, 5, 1.0, float("inf")).ends == every.ends[:5]


@pytest.mark.parametrize(("model", "hardware", "num_gpus", "version"), [
    ("llama-3-8b", "h100-sxm", 1, "auto"),  # v3: splits that change with the longest context
    ("llama-3-70b", "h100-sxm", 4, "v2"),
    ("llama-3-8b", "h100-sxm", 1, "vllm"),  # v1 and v2 in turn: a d that comes and goes
])
def test_step_costs_carry_their_sums_from_call_to_call(model, hardware, num_gpus, version):
    """A window's calls (each from the offset the previous ones ran to, with the sums carried; one
    that ran fewer steps than it priced, as a stop token leaves it) are `decode_step` of each step."""
    cost_model = _model(model, hardware, num_gpus, version, None)
    rng = random.Random(47)
    for n in (2, 5, 20):
        contexts = [rng.randint(1, 2000) for _ in range(n)]
        sums = StepSums(contexts)
        offset = 0
        for cap in (1, 3, 7, 1, 40, 2, 130, 5, 600):
            got = step_costs(cost_model, sums, offset, 16, cap, 0.0, float("inf"))
            for j, model_time in enumerate(got.model_times):
                expected = cost_model.decode_step([c + offset + j for c in contexts], 16)
                assert model_time == expected.total_s - expected.overhead_s, (n, offset, j)
                assert got.versions[j] == expected.decode_version
            ran = cap if cap < 100 else cap // 3  # the later calls run fewer steps than they priced
            offset += ran


@pytest.mark.parametrize(("model", "hardware", "num_gpus"), [
    ("llama-3-8b", "h100-sxm", 1), ("llama-3-70b", "h100-sxm", 4),
])
def test_step_of_a_decode_batch_takes_the_dense_parts_of_its_size(model, hardware, num_gpus):
    """`step` of a step that samples every token it computes reads its size's kept parts
    (`decode_parts`): they are `_dense`'s of that size, to the bit, on a first and a later step; a
    prefill step (more tokens than rows sampled) still prices its own."""
    cost_model = _model(model, hardware, num_gpus, "auto", None)
    L = cost_model.spec.num_layers
    for n in (1, 3, 64, 1, 3):
        shape = StepShape(n, n, n, decode_contexts=[100 + i for i in range(n)], block_size=16)
        got = cost_model.step(shape)
        linear, elementwise, communication, head = cost_model._dense(n, n)
        assert (got.linear_s, got.elementwise_s, got.communication_s, got.head_s) == (
            L * linear, L * elementwise, communication, head)
    prefill = StepShape(300, 1, 2, decode_contexts=[100], block_size=16, num_prefill_rows=1, prefill_queries=299,
                        prefill_context=299, prefill_pairs=299 * 150)
    linear, _, _, head = cost_model._dense(300, 1)
    got = cost_model.step(prefill)
    assert (got.linear_s, got.head_s) == (L * linear, head) and 300 not in cost_model._decode_parts
