"""Steps from CUDA graphs on a real GPU (decode steps, and prefill and mixed steps keyed on padded
shape): the same tokens as eager steps, replays counted, and no synchronisation inside a forward
(torch's sync debug mode set to error). Where CUDA is absent every test is skipped with that reason;
`tests/test_step_plan.py` and `tests/test_mixed_graphs.py` cover what a graph replays (the padded
batch) on the CPU backends, emu running the same kernel sources."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.runner import drive
from paged.kernels.backends.cuda import BACKEND as CUDA
from paged.request import Request, SamplingParams

_UNAVAILABLE = CUDA.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"needs a CUDA GPU: {_UNAVAILABLE}")

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 33, 2, 60, 9)]


def _engine(*overrides: str) -> Engine:
    cfg = compose_config(["model=tiny-random", "logger=none", "progress=false", "model.device=cuda",
                          "model.dtype=float32", "kernel.backend=cuda", "allocator.num_blocks=256", *overrides])
    return build_engine(cfg)


def _generate(engine: Engine, max_tokens: int = 24) -> list[list[int]]:
    requests = [Request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    drive(engine)
    return [r.seqs[0].output_token_ids for r in requests]


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_graphs_on_and_off_give_the_same_tokens(version: str) -> None:
    eager = _engine("executor.cuda_graphs=false", f"kernel.version={version}")
    graphs = _engine("executor.cuda_graphs=true", f"kernel.version={version}")
    assert _generate(graphs) == _generate(eager)
    assert graphs.executor.decode_step_counts()["cuda_graph_steps"] > 0
    assert eager.executor.decode_step_counts()["cuda_graph_steps"] == 0


def test_graphs_are_the_default_on_cuda_and_over_size_batches_run_eagerly() -> None:
    engine = _engine("scheduler.max_num_seqs=4")
    assert engine.executor.graphs is not None and engine.executor.graphs.sizes == [1, 2, 4]
    _generate(engine)
    counts = engine.executor.decode_step_counts()
    assert counts["cuda_graph_steps"] > 0


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_chunked_prefill_and_mixed_steps_replay_graphs_with_the_eager_tokens(version: str) -> None:
    """A 32-token budget chunks the prompts beside decodes: every step, prefill and mixed ones too,
    replays a graph (no capture fails), and the tokens are the eager engine's."""
    chunked = ("scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=4", f"kernel.version={version}")
    eager = _engine("executor.cuda_graphs=false", *chunked)
    graphs = _engine("executor.cuda_graphs=true", *chunked)
    assert _generate(graphs, max_tokens=8) == _generate(eager, max_tokens=8)
    counts = graphs.executor.decode_step_counts()
    assert counts["eager_mixed_steps"] == 0 and counts["eager_decode_steps"] == 0 and counts["cuda_graph_steps"] > 0
    assert eager.executor.decode_step_counts()["eager_mixed_steps"] > 0


def test_prefill_and_mixed_forwards_have_no_synchronisation() -> None:
    """What a capture of a step with prompt tokens needs: no forward of a chunked run waits on the device."""
    engine = _engine("executor.cuda_graphs=false", "scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=4")
    model = engine.executor.model
    forward = model.forward
    calls = {"n": 0}

    def strict(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model.forward = strict
    _generate(engine, max_tokens=4)
    assert calls["n"] > 1 and engine.executor.decode_step_counts()["eager_mixed_steps"] > 1


def test_decode_forward_has_no_synchronisation() -> None:
    engine = _engine("executor.cuda_graphs=false")
    model = engine.executor.model
    forward = model.forward
    calls = {"n": 0}

    def strict(*args: Any, **kwargs: Any) -> torch.Tensor:
        """Every forward after the first (the prompts' prefill) is a decode step's."""
        calls["n"] += 1
        if calls["n"] == 1:
            return forward(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model.forward = strict
    _generate(engine, max_tokens=6)
    assert calls["n"] > 1
