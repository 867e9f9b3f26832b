"""How experiments/gpu/kernel_bench.py times a call, and the bandwidth probes its percentages divide by.

On CUDA a kernel is captured `iters` times into one CUDA graph, rotating over input sets larger than
L2, and the graph is replayed between CUDA events (kernel_bench.py's docstring says why); a path that
cannot be captured (the torch reference, which allocates per call) is timed eagerly between events.
On the CPU every path is a host loop between `time.perf_counter` calls. Each sample is µs per call;
a `Timing` is their median and spread.

Probes, over a buffer far past L2 (1 GiB on CUDA, 256 MiB on the CPU), timed as the kernels are:
- copy: `dst.copy_(src)`, bytes read + written per second (the earlier tables' denominator);
- read: each byte read once and reduced to one number. `torch.sum(dtype=float32)` of an fp16 buffer
  (torch's vectorised reduction; fp32 on the CPU), and on CUDA with Triton importable a streaming-load kernel
  (kernel_read_probe.py); the faster is the read bandwidth, which kernel_bench's % divide by.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CUDA_PROBE_BYTES = 1 << 30
CPU_PROBE_BYTES = 256 << 20
PROBE_CALLS = 10  # probe passes per graph: each takes ~0.3-1 ms on CUDA, well above event resolution
CPU_CACHE_FALLBACK = 32 << 20  # last-level cache assumed where sysconf does not say
# Rotating inputs span this many cache (L2) sizes: a margin, since L2 replacement is not strict LRU.
L2_MULTIPLE = 3
# Sets below 3 * 50 MiB / 512 = 300 KiB take ~0.1 µs of DRAM time, far under a call's latency, so
# whether they hit L2 no longer matters; more sets would only lengthen warm-up and capture.
MAX_SETS = 512
# On the CPU a call takes milliseconds and the table is a smoke test: a few sets keep it quick.
CPU_MAX_SETS = 4
# Share of free memory the rotating sets may take; the rest is for scratch, graph pools and the reference.
MEMORY_FRACTION = 0.5


def reason(e: BaseException) -> str:
    """An exception in one short line, for a table's note."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


@dataclass(frozen=True)
class Timing:
    """µs per call: the median of repeated measurements, and half their interquartile range as % of it."""

    us: float
    spread: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        median = statistics.median(samples)
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(median, 50 * (q3 - q1) / median)


@dataclass(frozen=True)
class Probe:
    """A measured bandwidth (bytes per second at the median), its timing and how it was taken."""

    bandwidth: float
    timing: Timing
    method: str


def _event_samples(run: Callable[[], object], calls_per_run: int, repeats: int) -> list[float]:
    """µs per call of `run` (which makes `calls_per_run` calls), once per repeat."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / calls_per_run)
    return samples


def _loop(calls: Sequence[Callable[[], object]], length: int) -> Callable[[], None]:
    def loop() -> None:
        for i in range(length):
            calls[i % len(calls)]()

    return loop


@dataclass(frozen=True)
class Timer:
    """Times calls on one device: `iters` calls per measurement (whole rotations), `repeats` of them."""

    device: torch.device
    iters: int
    repeats: int

    def length(self, sets: int) -> int:
        return -(-self.iters // sets) * sets  # every set equally often

    def graphed(self, calls: Sequence[Callable[[], object]]) -> Timing:
        """One CUDA graph of `length` calls cycling through `calls`, replayed `repeats` times.

        Each call runs once eagerly on a side stream before capture, as torch requires: that
        compiles, loads and configures the kernels, and lets an op memoise its checks for these very
        tensors, so nothing in the captured region synchronises with the host. It also raises a
        kernel's refusal before any capture begins. On the CPU: a host loop."""
        if self.device.type != "cuda":
            return self.eager(calls)
        length = self.length(len(calls))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # captures on its own non-default stream
            _loop(calls, length)()
        graph.replay()  # the first replay uploads the graph; keep it out of the samples
        return Timing.of(_event_samples(graph.replay, length, self.repeats))

    def eager(self, calls: Sequence[Callable[[], object]]) -> Timing:
        """As `graphed`, with the calls issued from Python each time: host overhead included."""
        length = self.length(len(calls))
        for call in calls:
            call()
        loop = _loop(calls, length)
        if self.device.type == "cuda":
            return Timing.of(_event_samples(loop, length, self.repeats))
        samples = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            loop()
            samples.append((time.perf_counter() - start) * 1e6 / length)
        return Timing.of(samples)

    def cache_bytes(self) -> int:
        """L2 on CUDA, the last-level cache on the CPU: what rotating inputs must exceed."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).L2_cache_size
        try:
            return os.sysconf("SC_LEVEL3_CACHE_SIZE") or CPU_CACHE_FALLBACK
        except (ValueError, OSError):
            return CPU_CACHE_FALLBACK

    def free_bytes(self) -> int:
        """Memory the device has free now."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # so that free memory counts what earlier rows released
            return torch.cuda.mem_get_info(self.device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def set_count(self, set_bytes: int) -> int:
        """Independent input sets of `set_bytes` each, together over `L2_MULTIPLE` cache sizes (at
        least two, at most `MAX_SETS`) where memory allows. Only sets many times larger than the
        cache are cut short, and the cache holds a negligible share of such a set."""
        most = MAX_SETS if self.device.type == "cuda" else CPU_MAX_SETS
        wanted = min(most, max(2, -(-L2_MULTIPLE * self.cache_bytes() // set_bytes)))
        return max(1, min(wanted, int(self.free_bytes() * MEMORY_FRACTION) // set_bytes))

    def _probe(self, calls: Callable[[], object]) -> Timing:
        timer = Timer(self.device, PROBE_CALLS, self.repeats)
        return timer.graphed([calls])

    def copy_probe(self) -> Probe:
        """Device-to-device copy of a buffer far past the cache: bytes read + written per second."""
        size = CUDA_PROBE_BYTES if self.device.type == "cuda" else CPU_PROBE_BYTES
        src = torch.empty(size, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        timing = self._probe(lambda: dst.copy_(src))
        return Probe(2 * size / (timing.us * 1e-6), timing, f"copy_ of {size >> 20} MiB, read + written")

    def read_probes(self) -> tuple[Probe, list[str]]:
        """The fastest read-only pass over a buffer far past the cache, and a line per method tried."""
        cuda = self.device.type == "cuda"
        size = CUDA_PROBE_BYTES if cuda else CPU_PROBE_BYTES
        # fp16 as the caches are on CUDA; on the CPU, whose fp16 sum converts element by element, fp32
        dtype = torch.float16 if cuda else torch.float32
        buf = torch.ones(size // dtype.itemsize, dtype=dtype, device=self.device)
        timing = self._probe(lambda: buf.sum(dtype=torch.float32))
        what = f"torch.sum(float32) of {size >> 20} MiB {str(dtype).removeprefix('torch.')}"
        probes = [Probe(size / (timing.us * 1e-6), timing, what)]
        notes = []
        if cuda:
            try:
                from kernel_read_probe import triton_read  # Triton: on CUDA machines only

                timing = self._probe(triton_read(buf))
                probes.append(Probe(size / (timing.us * 1e-6), timing, f"Triton streaming load of {size >> 20} MiB"))
            except Exception as e:  # ImportError without Triton; a compile error: the torch probe stands
                notes.append(f"Triton read probe unavailable: {reason(e)}")
        notes += [f"{p.method}: {p.bandwidth / 1e9:.0f} GB/s (±{p.timing.spread:.0f}%)" for p in probes]
        return max(probes, key=lambda p: p.bandwidth), notes
