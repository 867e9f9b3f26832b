"""The peers experiments/gpu/kernel_bench.py times beside our kernels, on the same shapes in the same run:

- `sdpa-flash`, `sdpa-cudnn`: torch SDPA restricted to FlashAttention / cuDNN attention
  (`torch.nn.attention.sdpa_kernel`) on contiguous K/V `[batch, kv_heads, context, head]`: no page
  table at all, the non-paged upper anchor. GQA through `enable_gqa=True`, so K/V are read once per
  KV head; where a backend refuses that, through K/V repeated to the query heads (each query head then
  reads its own copy: 8x the bytes, which the cell's note says; the % still counts unique bytes);
- `flex`: torch FlexAttention's paged decode, `torch.compile(flex_attention)` over K/V laid out as one
  long sequence of pages, with a `BlockMask` built from our block tables (each row's blocks as its
  full KV blocks, a partial last block masked), as torch.nn.attention.experimental._paged_attention
  converts a logical mask; compiled afresh per row (`torch._dynamo.reset()`), so no row meets
  torch.compile's recompile limit and falls back to eager;
- `flashinfer`: FlashInfer's batch decode (its CUDA-core template in `use_cuda_graph` mode) over HND
  pages with our block tables, built from `--flashinfer-src` with this machine's nvcc
  (flashinfer_peer/); the only peer with an fp8 cache.

Every peer is timed as a CUDA graph like ours, over its own rotating sets (the same data generator,
converted to its layout); its first set's output is checked against our v2 on the same data (atol
2e-3, rtol 2e-2) and a disagreement is noted. A peer that cannot run a cell leaves it empty with a note
saying why; nothing a peer does stops the run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from inspect import signature
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_inputs import (
    BLOCK_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    SCALE,
    Inputs,
    contiguous,
    hnd_pages,
    one_sequence,
    random_set,
    set_bytes,
)
from kernel_timing import Timer, Timing, reason

PEERS = ("sdpa-flash", "sdpa-cudnn", "flex", "flashinfer")
ATOL, RTOL = 2e-3, 2e-2
GROUP = NUM_HEADS // NUM_KV_HEADS

Reference = Callable[[Inputs], torch.Tensor]
Call = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Cell:
    """A peer's timing in one row, or None, and a note: why it is missing, or a caveat."""

    timing: Timing | None
    note: str | None = None


class _Shape:
    """One row's shape and where its sets come from."""

    def __init__(self, timer: Timer, batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                 reference: Reference) -> None:
        self.timer, self.batch, self.context, self.dtype, self.kv_dtype = timer, batch, context, dtype, kv_dtype
        self.reference = reference
        self.bytes = set_bytes(batch, context, dtype, kv_dtype)

    def sets(self, convert: Callable[[Inputs], object], repeat: int = 1) -> tuple[list[object], torch.Tensor]:
        """`convert` of each rotating set (our layout dropped once converted), and our v2's output on
        the first; `repeat`: the converted set is that many times larger."""
        size = self.bytes * (1 + repeat)  # ours and the converted one, while converting
        if size > self.timer.free_bytes():
            raise MemoryError(f"a set and its {repeat}x conversion, {size / 2**30:.1f} GiB, would not fit")
        converted, expected = [], None
        for i in range(self.timer.set_count(self.bytes * repeat)):
            inputs = random_set(self.batch, self.context, self.dtype, self.kv_dtype, self.timer.device)
            if i == 0:
                expected = self.reference(inputs)
            converted.append(convert(inputs))
        return converted, expected


def _checked(timer: Timer, calls: list[Call], expected: torch.Tensor, caveat: str | None = None) -> Cell:
    """Times `calls` and compares the first one's output with `expected`."""
    got = calls[0]().reshape(expected.shape).float()
    diff = (got - expected.float()).abs()
    notes = [caveat] if caveat else []
    if bool((diff > ATOL + RTOL * expected.float().abs()).any()):
        notes.append(f"differs from ours: max |diff| {diff.max().item():.3g}")
    return Cell(timer.graphed(calls), "; ".join(notes) or None)


def _sdpa(shape: _Shape, backend: torch.nn.attention.SDPBackend) -> Cell:
    def convert(inputs: Inputs, repeat: int) -> tuple[torch.Tensor, ...]:
        k, v = (contiguous(pages, inputs.block_tables, shape.context) for pages in hnd_pages(inputs))
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return inputs.query.unsqueeze(2), k, v

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=gqa)

    sets, expected = shape.sets(functools.partial(convert, repeat=1))
    calls = [functools.partial(call, *s, gqa=True) for s in sets]
    try:
        calls[0]()
    except RuntimeError as e:  # "No available kernel": this backend takes no GQA
        if isinstance(e, torch.OutOfMemoryError):
            raise
        refused = reason(e)
    else:
        return _checked(shape.timer, calls, expected)
    del sets, calls
    sets, expected = shape.sets(functools.partial(convert, repeat=GROUP), repeat=GROUP)
    calls = [functools.partial(call, *s, gqa=False) for s in sets]
    return _checked(shape.timer, calls, expected,
                    f"K/V repeated to the query heads, {GROUP}x the bytes read (enable_gqa=True refused: {refused})")


@functools.cache
def _flex_mask_mod(remainder: int) -> Callable[..., torch.Tensor]:
    """The mask of a partial last block: its first `remainder` slots, by the physical index's offset."""

    def mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv % BLOCK_SIZE < remainder

    return mask


def _flex(shape: _Shape) -> Cell:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    full, remainder = divmod(shape.context, BLOCK_SIZE)
    # the backward's q-block lists would be a dense [batch, blocks] scan per set; decode needs none
    forward_only = {"compute_q_blocks": False} if "compute_q_blocks" in signature(BlockMask.from_kv_blocks).parameters \
        else {}

    def convert(inputs: Inputs) -> tuple[torch.Tensor, ...]:
        k, v = (one_sequence(pages) for pages in hnd_pages(inputs))
        b, per_row = inputs.block_tables.shape
        device = k.device
        # index lists as wide as the whole page pool, as _paged_attention's converted masks are: flex
        # checks the mask's KV extent against the K/V's
        full_indices = torch.zeros(b, 1, 1, k.shape[2] // BLOCK_SIZE, dtype=torch.int32, device=device)
        full_indices[..., :per_row] = inputs.block_tables[:, None, None, :]
        partial_indices = torch.zeros_like(full_indices)
        partial_indices[..., 0] = full_indices[..., per_row - 1]
        mask = BlockMask.from_kv_blocks(
            torch.full((b, 1, 1), int(remainder > 0), dtype=torch.int32, device=device), partial_indices,
            torch.full((b, 1, 1), full, dtype=torch.int32, device=device), full_indices,
            BLOCK_SIZE=(128, BLOCK_SIZE), mask_mod=_flex_mask_mod(remainder), seq_lengths=(1, k.shape[2]),
            **forward_only,
        )
        return inputs.query.unsqueeze(2), k, v, mask

    sets, expected = shape.sets(convert)
    calls = [functools.partial(lambda q, k, v, m: compiled(q, k, v, block_mask=m, scale=SCALE, enable_gqa=True), *s)
             for s in sets]
    return _checked(shape.timer, calls, expected)


class Peers:
    """The peers asked for, each timed per row; `flashinfer_src` is FlashInfer's fetched headers."""

    def __init__(self, timer: Timer, names: list[str], flashinfer_src: Path | None) -> None:
        self.timer, self.names = timer, names
        self.unavailable: dict[str, str] = {}
        if timer.device.type != "cuda":
            self.unavailable = {name: "needs a CUDA device" for name in names}
        elif "flashinfer" in names:
            from flashinfer_peer.build import source_problem

            problem = source_problem(flashinfer_src)
            if problem:
                self.unavailable["flashinfer"] = f"not built: {problem}"
        self.flashinfer_src = flashinfer_src

    def row(self, batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype,
            reference: Reference) -> dict[str, Cell]:
        shape = _Shape(self.timer, batch, context, dtype, kv_dtype, reference)
        cells = {}
        for name in self.names:
            if name in self.unavailable:
                cells[name] = Cell(None, self.unavailable[name])
            elif kv_dtype != dtype and name != "flashinfer":
                cells[name] = Cell(None, "no fp8 K/V with fp16/bf16 queries")
            else:
                try:
                    cells[name] = self._run(name, shape)
                except Exception as e:  # a peer's failure is its cell's note, never the run's end
                    cells[name] = Cell(None, reason(e))
                if self.timer.device.type == "cuda":
                    torch.cuda.empty_cache()
        return cells

    def _run(self, name: str, shape: _Shape) -> Cell:
        if name == "sdpa-flash":
            return _sdpa(shape, torch.nn.attention.SDPBackend.FLASH_ATTENTION)
        if name == "sdpa-cudnn":
            return _sdpa(shape, torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
        if name == "flex":
            return _flex(shape)
        return self._flashinfer(shape)

    def _flashinfer(self, shape: _Shape) -> Cell:
        from flashinfer_peer.decode import BatchDecode

        pages_per_seq = -(-shape.context // BLOCK_SIZE)
        decode = BatchDecode(self.flashinfer_src, shape.dtype, shape.kv_dtype, shape.batch, NUM_HEADS, NUM_KV_HEADS,
                             BLOCK_SIZE, pages_per_seq, shape.context - (pages_per_seq - 1) * BLOCK_SIZE,
                             self.timer.device)

        def convert(inputs: Inputs) -> tuple[torch.Tensor, ...]:
            return (inputs.query, *hnd_pages(inputs), inputs.block_tables.flatten().contiguous())

        sets, expected = shape.sets(convert)
        calls = [functools.partial(decode.run, *s, scale=SCALE) for s in sets]
        return _checked(self.timer, calls, expected)
