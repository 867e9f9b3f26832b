"""Steps with prompt tokens as a CUDA graph replays them (`paged.executor.mixed_graphs`): the padded
batch's shapes, the shape each step is keyed on, and on every CPU backend (emu runs the CUDA
kernels' sources) the padded step of a real scheduler's batches giving the eager step's hidden
states bit for bit and writing what the eager step writes. The capture itself needs a GPU:
`tests/test_cuda_graphs.py`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import drive
from paged.executor.mixed_graphs import MixedShape, MixedShapes, row_sizes, token_sizes
from paged.executor.model_executor import ModelExecutor
from paged.executor.step_plan import HostBatch, InputBuffers, pad_mixed, plan_batch
from paged.experiment.summary import summarize
from paged.kernels.toolchain import host_compiler
from paged.request import Request, SamplingParams
from paged.step import ScheduledSeq, SchedulerOutput

BLOCK = 16
_NO_COMPILER = host_compiler.unavailable_reason()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
BACKENDS = ["torch", pytest.param("cpu", marks=needs_compiler), pytest.param("emu", marks=needs_compiler)]


def _mixed_batch() -> HostBatch:
    """Two decode rows (3 and 20 tokens of context) around a prefill row of 6 of its 10 tokens."""
    seqs = [Request(str(i), list(range(n)), SamplingParams(max_tokens=2)).seqs[0] for i, n in enumerate((3, 10, 20))]
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens, seqs[2].num_computed_tokens = 2, 4, 19
    return plan_batch(SchedulerOutput([ScheduledSeq(seqs[0], 1, [4]), ScheduledSeq(seqs[1], 6, [7]),
                                       ScheduledSeq(seqs[2], 1, [5, 6])]), BLOCK)


def test_pad_mixed_keeps_the_tokens_and_pads_each_op() -> None:
    host = _mixed_batch()
    padded = pad_mixed(host, tokens=16, decode_rows=4, prefill_rows=2, width=8, max_seq_len=128)
    assert padded.input_ids.tolist()[:8] == host.input_ids.tolist() and padded.input_ids.shape == (16,)
    assert padded.slot_mapping.tolist() == [*host.slot_mapping.tolist(), *[-1] * 8]
    assert padded.positions.tolist()[8:] == [0] * 8
    assert padded.sample_rows.tolist() == host.sample_rows.tolist() == [0, 6, 7]
    decode, prefill = padded.decode, padded.prefill
    assert decode is not None and prefill is not None
    # two padding decode rows read one token of block 0 through padding tokens 8 and 9
    assert decode.tokens.tolist() == [0, 7, 8, 9]
    assert decode.seq_lens.tolist() == [3, 20, 1, 1] and decode.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert decode.block_tables.shape == (4, 8) and decode.max_seq_len == 128
    np.testing.assert_array_equal(decode.block_tables[:2, :2], [[4, 0], [5, 6]])
    # the prefill op's query rows: its six, then the other padding tokens, past its last offset
    assert prefill.tokens.tolist() == [1, 2, 3, 4, 5, 6, *range(10, 16)]
    assert prefill.seq_lens.tolist() == [10, 0] and prefill.query_start_loc.tolist() == [0, 6, 6]
    assert prefill.block_tables.shape == (2, 8) and prefill.block_tables[0, 0] == 7
    assert prefill.max_query_len == 12 and prefill.max_seq_len == 128
    assert sorted([*decode.tokens.tolist(), *prefill.tokens.tolist()]) == list(range(16)), "each row once"


def test_pad_mixed_of_a_prefill_only_step_keeps_every_row_a_query() -> None:
    seqs = [Request(str(i), list(range(n)), SamplingParams(max_tokens=2)).seqs[0] for i, n in enumerate((3, 5))]
    host = plan_batch(SchedulerOutput([ScheduledSeq(seqs[0], 3, [1]), ScheduledSeq(seqs[1], 5, [2])]), BLOCK)
    padded = pad_mixed(host, tokens=16, decode_rows=0, prefill_rows=4, width=2, max_seq_len=32)
    assert padded.decode is None and padded.prefill is not None and padded.prefill.tokens is None
    assert padded.prefill.query_start_loc.tolist() == [0, 3, 8, 8, 8] and padded.prefill.max_query_len == 16
    assert padded.slot_mapping.tolist() == [*host.slot_mapping.tolist(), *[-1] * 8]


def test_pad_mixed_refuses_a_shape_too_small() -> None:
    host = _mixed_batch()
    with pytest.raises(AssertionError, match="8 tokens and 2 padding rows"):
        pad_mixed(host, tokens=8, decode_rows=4, prefill_rows=1, width=8, max_seq_len=128)


def test_sizes_are_bounded() -> None:
    assert token_sizes(100) == [8, 16, 32, 64, 128]
    assert token_sizes(4096 + 256) == [8, 16, 32, 64, 128, 256, 512, *range(1024, 4608 + 1, 512)]
    assert row_sizes(1) == [1] and row_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and row_sizes(65)[-1] == 128


def test_each_step_is_keyed_on_its_padded_shape() -> None:
    shapes = MixedShapes(max_num_seqs=4, max_num_batched_tokens=32, table_width=8)
    assert shapes.tokens == [8, 16, 32, 64] and shapes.rows == [1, 2, 4]
    host = _mixed_batch()  # 8 tokens, 2 decode rows, 1 prefill row
    assert shapes.of(host) == MixedShape(tokens=8, decode_rows=2, prefill_rows=1)
    decode_only = plan_batch(SchedulerOutput([ScheduledSeq(Request("d", [1, 2], SamplingParams()).seqs[0], 2, [3])]),
                             BLOCK)
    assert shapes.of(decode_only) == MixedShape(tokens=8, decode_rows=0, prefill_rows=1)
    narrow = MixedShapes(max_num_seqs=4, max_num_batched_tokens=32, table_width=1)
    assert narrow.of(host) is None, "a table wider than max_model_len needs runs eagerly"


def _config(backend: str, version: str) -> Any:
    return compose_config([
        "model=tiny-random", "logger=none", "progress=false", "model.device=cpu", "model.dtype=float32",
        f"kernel.backend={backend}", f"kernel.version={version}", "kernel.partition_size=32",
        "allocator.num_blocks=64", "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=32",
    ])


class PaddedAgainstEager:
    """Before each step with prompt tokens the executor runs, runs it eagerly and padded to its
    shape (as a replay would), from the same cache, and compares their hidden states and caches."""

    def __init__(self, ex: ModelExecutor) -> None:
        self.ex, self.run = ex, ex._run
        self.width = -(-ex.max_model_len // ex.block_size)
        self.shapes = MixedShapes(ex.max_num_seqs, ex.max_num_batched_tokens, self.width)
        # per step checked: its tokens, decode rows and prefill rows, and the shape they were padded to
        self.seen: list[tuple[int, int, int, MixedShape]] = []

    def __call__(self, host: HostBatch, version: str | None) -> tuple[torch.Tensor, Any]:
        shape = self.shapes.of(host)
        if shape is not None:
            caches = [*self.ex.key_caches, *self.ex.value_caches]
            before = [c.clone() for c in caches]
            buffers = InputBuffers(self.ex.device)
            eager = self.ex._forward(buffers.upload(host), version).clone()
            written = [c.clone() for c in caches]
            for c, b in zip(caches, before, strict=True):
                c.copy_(b)
            padded = pad_mixed(host, shape.tokens, shape.decode_rows, shape.prefill_rows, self.width,
                               self.width * self.ex.block_size)
            hidden = self.ex._forward(buffers.upload(padded), version)
            assert torch.equal(hidden[: host.num_tokens], eager), f"{shape}: padded hidden states differ"
            assert all(torch.equal(c, w) for c, w in zip(caches, written, strict=True)), f"{shape}: padding wrote"
            for c, b in zip(caches, before, strict=True):
                c.copy_(b)
            decode_rows = 0 if host.decode is None else host.decode.num_seqs
            assert host.prefill is not None
            self.seen.append((host.num_tokens, decode_rows, host.prefill.num_seqs, shape))
        return self.run(host, version)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_padded_steps_of_a_scheduler_are_the_eager_steps_bit_for_bit(backend: str, version: str) -> None:
    """Prompts chunked beside decodes (a 32-token budget, 4 sequences): prefill-only and mixed
    steps, padded with tokens, decode rows and prefill rows; summary.json counts them eager."""
    cfg = _config(backend, version)
    engine = build_engine(cfg)
    check = PaddedAgainstEager(engine.executor)
    engine.executor._run = check  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((2, 19, 40, 3, 11, 5)):
        engine.add_request(Request(str(i), list(range(7 + i, 7 + i + n)), params))
    drive(engine)
    seen = check.seen
    assert any(shape.decode_rows == 0 for *_, shape in seen) and any(shape.decode_rows for *_, shape in seen)
    assert any(shape.tokens > n + shape.decode_rows - d for n, d, _, shape in seen), "no padding token"
    assert any(shape.decode_rows > d for _, d, _, shape in seen), "no padding decode row"
    assert any(shape.prefill_rows > p for _, _, p, shape in seen), "no padding prefill row"
    summary = summarize(cfg, engine)
    assert summary["eager_mixed_steps"] == len(seen)
    assert summary["cuda_graph_steps"] == 0 and summary["eager_decode_steps"] > 0


def test_the_simulator_reports_no_step_counts() -> None:
    cfg = compose_config(["executor=sim", "logger=none", "progress=false"])
    engine = build_engine(cfg)
    engine.add_request(Request("0", list(range(5)), SamplingParams(max_tokens=2)))
    drive(engine)
    counts = summarize(cfg, engine)
    assert (counts["cuda_graph_steps"], counts["eager_decode_steps"], counts["eager_mixed_steps"]) == (None,) * 3


def test_the_graph_table_captures_a_key_once_keeps_a_failed_key_eager_and_holds_its_limit(monkeypatch) -> None:
    """`GraphTable` (decode and mixed graphs alike): the capture itself needs a GPU, so it is replaced
    by one that records its keys and fails for one of them."""
    from paged.executor import cuda_graphs

    captured = []

    def fake_capture(forward, inputs, version, device, pool):
        if inputs == "bad":
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(inputs)
        return cuda_graphs.Captured(graph=None, hidden=inputs)

    monkeypatch.setattr(cuda_graphs, "capture", fake_capture)
    table = cuda_graphs.GraphTable(forward=None, device=None, pool=(0, 0), limit=2)
    assert table.graph("a", None, "a", "a") is table.graph("a", None, "other", "a")  # captured once
    assert table.graph("b", None, "bad", "b") is None and not table.replays("b")  # failed: eager from then on
    assert table.graph("c", None, "c", "c") is not None
    assert captured == ["a", "c"]
    assert table.replays("a") and not table.replays("d")  # at its limit: only held keys replay
