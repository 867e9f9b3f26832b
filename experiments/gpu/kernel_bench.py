"""Paged decode attention latency: our v1 / v2 / v3, the torch reference and peers, on the same shapes.

Ours are the NVRTC-compiled kernels_cu/ kernels; the peers torch SDPA (flash / cuDNN), FlexAttention
and FlashInfer (kernel_peers.py), all measured in one run.

    python experiments/gpu/kernel_bench.py [--batch 1 4 16 64 256] [--context 512 1024 4096 16384]
        [--shapes 64x4096 256x1024 1x16384] [--dtype float16 bfloat16] [--kv-cache-dtype auto fp8_e4m3]
        [--iters 100] [--repeats 11] [--peers sdpa-flash sdpa-cudnn flex flashinfer]
        [--flashinfer-src .flashinfer] [--device auto|cuda|cpu] [--v3-splits 1 2 8] [--v3-stages 2 4 6]

Shapes: 64 query / 8 KV heads, head 128, block 16 (kernel_inputs.py), every `--batch` x `--context`
or the `--shapes` given; fp16 and bf16; `--kv-cache-dtype fp8_e4m3` adds rows with a one-byte cache
(per-head scales of 1), which reads half the bytes. Each kernel's cell is µs, ± spread and % of the
read probe: unique K+V bytes read (at the cache's element size) / time / the read-only bandwidth
probe (kernel_timing.py: the fastest single read pass over 1 GiB, torch.sum or Triton), so a reader
knows how far from the memory limit each kernel is; the device-to-device copy, the denominator of
the earlier tables in docs/gpu.md, is printed beside it. Then `auto` (what kernel=auto picks on this
backend), the faster of ours with its %, and fi/v3 (FlashInfer's µs over v3's: >= 0.9 means v3 is at
least 0.9x FlashInfer's speed). A cell that cannot run is `-` with a note number; notes print under
the row that first needs them. After the table, the issue's targets where their rows were measured.
`--v3-splits N ...` adds a column per N: v3 with its split count forced to N (the planner's choice
is the `v3` column), to see which count each row wants. Splits hold whole 32-token tiles, so an N
that does not divide a row's tiles gives the fewest splits of ceil(tiles / N) tiles (33 of 128: 32).
`--v3-stages N ...` adds a column `v3:sN` per N: v3 with its K/V pipeline forced N stages deep (the
planner's depth, paged/kernels/v3_layout.py's `v3_stages`, is the `v3` column; its split count is
the planner's in both), to see whether deeper pipelines pay on this device. A depth whose shared
memory the device cannot give a CTA is `-` with its note; the cpu backend has no such pipeline.

How it times, and why (kernel_timing.py):
- CUDA graphs. A small decode call runs for a few µs, less than the Python and launch overhead of
  issuing it, so timing back-to-back eager calls measures the host. Each kernel is captured `--iters`
  times into one CUDA graph (after one eager warm-up call per input set on a side stream) and the
  graph is replayed between CUDA events; µs per call = elapsed / calls in the graph. The peers too.
- L2 rotation. K/V that stay in L2 (50 MB on an H100) from one call to the next are read faster than
  DRAM allows, and a % could pass 100. Each row allocates several independent input sets, together
  over 3x the L2 size, and consecutive calls in the graph cycle through them.
- Median and spread: each graph is replayed `--repeats` times; a cell shows the median µs and, after
  ±, half the interquartile range as % of the median. The % uses the median.
- The torch reference allocates per call and is there as a scale, not a contender, so it is timed
  eagerly (host overhead included), and skipped where its fp32 copies of K/V would not fit.
The peers (kernel_peers.py) each get their own input sets in their own layout, and have their first
output checked against our v2's.

`--device auto` (the default): on a GPU, NVRTC compile times and then the table; without one, NVRTC
cold (fresh cache) and warm (cache hit) compile times only. `--device cpu`: the table on this CPU
(the native cpu backend, host timing; GPU peers noted as skipped), for a smoke test.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when imported by path
from kernel_inputs import NUM_HEADS, SCALE, Inputs, kv_bytes, random_set, set_bytes  # noqa: E402
from kernel_peers import PEERS, Cell, Peers  # noqa: E402
from kernel_targets import check_targets  # noqa: E402
from kernel_timing import Probe, Timer, Timing, reason  # noqa: E402

from paged import kernels  # noqa: E402
from paged.config.choices import VERSIONS  # noqa: E402
from paged.kernels.backends.interface import CacheView  # noqa: E402
from paged.kernels.features import KV_CACHE_DTYPES, NONE, cache_dtype  # noqa: E402
from paged.kernels.limits import DEFAULT_PARTITION_SIZE  # noqa: E402
from paged.kernels.split_plan import MAX_SPLITS  # noqa: E402
from paged.kernels.toolchain import nvrtc, specs  # noqa: E402
from paged.kernels.toolchain.cache_dir import ENV_VAR  # noqa: E402
from paged.kernels.v3_layout import MAX_STAGES, MIN_STAGES  # noqa: E402

TORCH_MAX_BYTES = 2 << 30  # the reference gathers K/V into fp32 copies; beyond this it would not fit
DTYPE_LABELS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
KV_LABELS = {"auto": "=", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
DEFAULT_FLASHINFER_SRC = Path(__file__).resolve().parents[2] / ".flashinfer"
CELL = 22  # characters of one kernel's cell


def compile_times(arch: str, full: bool) -> None:
    units = specs.dispatchable_units() if full else specs.default_units()
    what = "every dispatchable instantiation" if full else "default configurations (fp16/bf16, h128, b16)"
    nvrtc.toolchain()
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {ENV_VAR: cache}):
        start = time.perf_counter()
        cold = nvrtc.compile_units(units, arch)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = nvrtc.compile_units(units, arch)
        warm_s = time.perf_counter() - start
    assert not any(c.cached for c in cold) and all(c.cached for c in warm)
    kernels_n = sum(len(u.kernels) for u in units)
    slowest = max(cold, key=lambda c: c.compile_s)
    spills = sum(1 for c in cold for i in c.infos if i.spill_stores or i.spill_loads)
    print(f"NVRTC {'.'.join(map(str, nvrtc.toolchain().version))}, {arch}, {what}: {len(units)} units / "
          f"{kernels_n} kernels")
    print(f"  cold (fresh cache): {cold_s:8.2f} s   slowest unit {slowest.unit.label} {slowest.compile_s:.2f} s")
    print(f"  warm (cache hit):   {warm_s:8.3f} s")
    print(f"  kernels with register spills: {spills}")


class Notes:
    """Numbered notes for cells that are empty or carry a caveat; each is printed once, under the row
    that first needs it."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}
        self.pending: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.numbers:
            self.numbers[text] = len(self.numbers) + 1
            self.pending.append(f"  [{self.numbers[text]}] {text}")
        return f"[{self.numbers[text]}]"

    def flush(self) -> None:
        for line in self.pending:
            print(line)
        self.pending.clear()


def _cell(name: str, cell: Cell, bytes_read: int, read: Probe, notes: Notes) -> str:
    """`µs ±spread% read%`, or `-`; a note's number after it."""
    mark = notes.mark(f"{name}: {cell.note}") if cell.note else ""
    if cell.timing is None:
        return f"{'-' + mark:>{CELL}}"
    t = cell.timing
    pct = 100 * bytes_read / (t.us * 1e-6) / read.bandwidth
    return f"{t.us:.1f} ±{t.spread:.0f}% {pct:.0f}%{mark}".rjust(CELL)


def our_backend(device: torch.device) -> str:
    """cuda on a GPU; on the CPU the native backend where it loads, else the torch reference."""
    if device.type == "cuda":
        return "cuda"
    return "cpu" if kernels.get_backend("cpu").unavailable_reason() is None else "torch"


class Bench:
    """The table: our kernels and the peers per row, the probes once, the results kept for the targets."""

    def __init__(self, timer: Timer, peers: Peers, v3_splits: Sequence[int] = (),
                 v3_stages: Sequence[int] = ()) -> None:
        self.timer, self.peers, self.notes = timer, peers, Notes()
        self.v3_splits, self.v3_stages = tuple(v3_splits), tuple(v3_stages)
        self.backend = our_backend(timer.device)
        self.copy = timer.copy_probe()
        self.read, self.read_lines = timer.read_probes()
        # (batch, context, dtype label, kv label) -> kernel name -> timing
        self.results: dict[tuple[int, int, str, str], dict[str, Timing | None]] = {}

    def _calls(self, sets: list[Inputs], context: int, backend: str, version: str,
               scales: dict[str, torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
        # All sequences have the same length, so one seq_lens tensor serves every set; the warm-up
        # calls use the very tensors the graph captures, so a check the op memoises per tensor
        # (max_seq_len against seq_lens, which syncs with the host) is done before capture.
        seq_lens = torch.full((sets[0].query.shape[0],), context, dtype=torch.int32, device=self.timer.device)
        return [functools.partial(kernels.paged_attention, s.query, s.key_cache, s.value_cache, s.block_tables,
                                  seq_lens, SCALE, version=version, backend=backend, max_seq_len=context, **scales)
                for s in sets]

    def _forced_v3(self, sets: list[Inputs], context: int, scales: dict[str, torch.Tensor], splits: int | None = None,
                   stages: int | None = None) -> list[Callable[[], torch.Tensor]]:
        """v3 with `splits` splits or a `stages`-deep pipeline (None: the planner's), through the
        backend with a workspace planned for them."""
        backend = kernels.get_backend(self.backend)
        first = sets[0]
        batch, heads, head = first.query.shape
        _, kv_heads, _, block = first.value_cache.shape
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=self.timer.device)
        workspace = backend.decode_workspace(batch, heads, kv_heads, head, block, "v3", DEFAULT_PARTITION_SIZE,
                                             context, None, self.timer.device, first.key_cache.dtype,
                                             num_splits=splits, num_stages=stages)
        return [functools.partial(backend.paged_attention, s.query,
                                  CacheView(s.key_cache, s.value_cache, s.block_tables, seq_lens,
                                            scales.get("k_scale"), scales.get("v_scale")),
                                  SCALE, "v3", DEFAULT_PARTITION_SIZE, context, None, NONE, workspace)
                for s in sets]

    def row(self, batch: int, context: int, dtype: torch.dtype, kv: str) -> str:
        kv_dtype = cache_dtype(kv, dtype)
        device = self.timer.device
        count = self.timer.set_count(set_bytes(batch, context, dtype, kv_dtype))
        sets = [random_set(batch, context, dtype, kv_dtype, device) for _ in range(count)]
        scales = {}
        if kv_dtype != dtype:
            ones = torch.ones(sets[0].key_cache.shape[1], device=device)
            scales = {"k_scale": ones, "v_scale": ones}
        cells: dict[str, Cell] = {}
        for version in VERSIONS:
            try:
                cells[version] = Cell(self.timer.graphed(self._calls(sets, context, self.backend, version, scales)))
            except Exception as e:  # v1 past the device's shared memory, a version not built yet
                cells[version] = Cell(None, reason(e))
        forced = [(f"v3/{n}", {"splits": n}) for n in self.v3_splits]
        forced += [(f"v3:s{n}", {"stages": n}) for n in self.v3_stages]
        for name, force in forced:
            try:
                cells[name] = Cell(self.timer.graphed(self._forced_v3(sets, context, scales, **force)))
            except Exception as e:  # more splits than the scratch allows, a depth past the shared memory
                cells[name] = Cell(None, reason(e))
        bytes_read = kv_bytes(batch, context, kv_dtype)
        cells["torch"] = Cell(None, "its fp32 copies of K/V would not fit")
        if 2 * bytes_read <= TORCH_MAX_BYTES:
            cells["torch"] = Cell(self.timer.eager(self._calls(sets, context, "torch", "v1", scales)))
        del sets

        def reference(inputs: Inputs) -> torch.Tensor:
            return self._calls([inputs], context, self.backend, "v2", scales)[0]()

        cells |= self.peers.row(batch, context, dtype, kv_dtype, reference)
        label = (batch, context, DTYPE_LABELS[dtype], KV_LABELS[kv])
        self.results[label] = {name: cell.timing for name, cell in cells.items()}
        ours = {v: cells[v].timing for v in VERSIONS if cells[v].timing is not None}
        best = "-"
        if ours:
            name = min(ours, key=lambda n: ours[n].us)
            best = f"{name} {100 * bytes_read / (ours[name].us * 1e-6) / self.read.bandwidth:.0f}%"
        v3, fi = cells["v3"].timing, cells.get("flashinfer", Cell(None)).timing
        ratio = f"{fi.us / v3.us:.2f}" if v3 is not None and fi is not None else "-"
        auto = kernels.choose_version(context, batch, NUM_HEADS, backend=self.backend)
        return " ".join([
            f"{batch:>6} {context:>8} {label[2]:>5} {label[3]:>5}",
            *(_cell(name, cells[name], bytes_read, self.read, self.notes) for name in self.columns),
            f"{auto:>5} {best:>8} {ratio:>6}",
        ])

    @property
    def columns(self) -> list[str]:
        return [*VERSIONS, *(f"v3/{n}" for n in self.v3_splits), *(f"v3:s{n}" for n in self.v3_stages), "torch",
                *self.peers.names]

    def print_header(self) -> None:
        device = self.timer.device
        where = "this CPU"
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            where = f"{props.name}: L2 {props.L2_cache_size / 2**20:.0f} MiB"
        print(f"{where}; device-to-device copy {self.copy.bandwidth / 1e9:.0f} GB/s (±{self.copy.timing.spread:.0f}%), "
              f"read probe {self.read.bandwidth / 1e9:.0f} GB/s ({self.read.method})")
        for line in self.read_lines:
            print(f"  read probe: {line}")
        how = "CUDA-graph replays" if device.type == "cuda" else "host-timed loops"
        print(f"ours ({self.backend} backend) and the peers: median of {self.timer.repeats} {how} of >= "
              f"{self.timer.iters} calls rotating over input sets; ±: half the interquartile range; "
              "%: unique K/V bytes / time / read probe. torch: eager, host included")
        print("kv: the cache's dtype ('=': the query's; e4m3 / e5m2: fp8, whose % counts its one-byte reads); "
              "fi/v3: flashinfer µs / v3 µs")
        heads = "".join(f" {name + ' µs ± %':>{CELL}}" for name in self.columns)
        print(f"{'batch':>6} {'context':>8} {'dtype':>5} {'kv':>5}{heads} {'auto':>5} {'best':>8} {'fi/v3':>6}")


def parse_shape(text: str) -> tuple[int, int]:
    """`BATCHxCONTEXT`, e.g. 64x4096."""
    try:
        batch, context = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxCONTEXT, e.g. 64x4096") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and context must be >= 1")
    return batch, context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", help="BATCHxCONTEXT rows instead of the grid")
    parser.add_argument("--dtype", nargs="+", choices=["float16", "bfloat16"], default=["float16", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", *KV_CACHE_DTYPES], default=["auto"],
                        help="cache dtypes per row (auto: the query's)")
    parser.add_argument("--iters", type=int, default=100, help="calls per CUDA graph (rounded up to whole rotations)")
    parser.add_argument("--repeats", type=int, default=11, help="graph replays per cell; the median is reported")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS), help="peers to time (none: no peers)")
    parser.add_argument("--flashinfer-src", type=Path, default=DEFAULT_FLASHINFER_SRC if DEFAULT_FLASHINFER_SRC.is_dir()
                        else None, help="FlashInfer headers from flashinfer_peer/build.py fetch (default: .flashinfer/ "
                        "where it exists)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--arch", default="sm_90", help="compile target when no GPU is present")
    parser.add_argument("--full", action="store_true", help="time every instantiation, not only the defaults")
    parser.add_argument("--v3-splits", type=int, nargs="+", default=[],
                        help="also time v3 with its split count forced to each (a column each)")
    parser.add_argument("--v3-stages", type=int, nargs="+", default=[],
                        help="also time v3 with its K/V pipeline forced this many stages deep (a column each)")
    args = parser.parse_args()
    if args.iters < 1 or args.repeats < 3:
        parser.error("--iters must be at least 1 and --repeats at least 3 (for an interquartile range)")
    bad = [n for n in args.v3_splits if not 1 <= n <= MAX_SPLITS]
    if bad:
        parser.error(f"--v3-splits {bad[0]} is not a split count; allowed: 1..{MAX_SPLITS}")
    bad = [n for n in args.v3_stages if not MIN_STAGES <= n <= MAX_STAGES]
    if bad:
        parser.error(f"--v3-stages {bad[0]} is not a v3 pipeline depth; allowed: {MIN_STAGES}..{MAX_STAGES}")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if device == "auto":
        if not torch.cuda.is_available():
            compile_times(args.arch, args.full)
            print("no CUDA device: no kernel timing was taken (compile times only; --device cpu times this CPU)")
            return
        device = "cuda"
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        compile_times(f"sm_{major}{minor}", args.full)
    timer = Timer(torch.device(device), args.iters, args.repeats)
    bench = Bench(timer, Peers(timer, args.peers, args.flashinfer_src), args.v3_splits, args.v3_stages)
    bench.print_header()
    shapes = args.shapes or [(b, c) for b in args.batch for c in args.context]
    for batch, context in shapes:
        for dtype in (getattr(torch, d) for d in args.dtype):
            for kv in args.kv_cache_dtype:
                print(bench.row(batch, context, dtype, kv), flush=True)
                bench.notes.flush()
    for line in check_targets(bench.results, bench.read.bandwidth):
        print(line)


if __name__ == "__main__":
    main()
