"""The packed linear's weights on 4 KB pages against 2 MB pages (madvise(MADV_HUGEPAGE) on a 2 MB-aligned
buffer), the same kernels, one process: SmolLM2-135M's 120 layer calls of a decode step, as linear_ab.py.

    python experiments/results/bench-vs-vllm/issue47-prefetch/huge_pages_ab.py bfloat16|float32 [rows ...]

Needs transparent huge pages in `madvise` or `always` mode (/sys/kernel/mm/transparent_hugepage/enabled).
Copies packed in the order 4K, 2M, 2M, 4K after an untimed first one (linear_ab.py says why); prints ms a
step for each kind (the median over its two copies) and each copy's own.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # linear_ab.py, which also sets up paged's thread wait
# isort: off
from linear_ab import LAYERS, SHAPES, step  # noqa: E402
import torch  # noqa: E402
# isort: on

from paged.kernels import packed_linear  # noqa: E402
from paged.kernels.backends import cpu as cpu_backend  # noqa: E402

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


class HugePageLinear(packed_linear.PackedLinear):
    """A PackedLinear whose packed weight lies in a 2 MB-aligned buffer advised to take huge pages
    before the packing first touches it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        nbytes = self.packed.numel() * self.packed.element_size()
        self._buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        offset = -self._buffer.data_ptr() % HUGE_PAGE
        # whole huge pages where they fit in the buffer (the last may not: its tail stays on 4 KB pages)
        length = min((nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, self._buffer.numel() - offset) // 4096 * 4096
        if LIBC.madvise(ctypes.c_void_p(self._buffer.data_ptr() + offset), ctypes.c_size_t(length), MADV_HUGEPAGE):
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
        packed = self._buffer[offset:offset + nbytes].view(self.packed.dtype).view(self.packed.shape)
        packed.copy_(self.packed)
        self.packed = packed


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("bfloat16", "float32") or not all(r.isdigit() for r in sys.argv[2:]):
        sys.exit(f"usage: {Path(__file__).name} bfloat16|float32 [rows ...], got {' '.join(sys.argv[1:]) or 'nothing'}")
    dtype = getattr(torch, sys.argv[1])
    rows_list = [int(r) for r in sys.argv[2:]] or [1, 8, 16, 32]
    cpu_backend.load()
    torch.manual_seed(0)
    weights = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES] for _ in range(LAYERS)]
    spare = [[packed_linear.PackedLinear(w) for w in layer] for layer in weights]
    kinds = (packed_linear.PackedLinear, HugePageLinear, HugePageLinear, packed_linear.PackedLinear)
    builds = [[[kind(w) for w in layer] for layer in weights] for kind in kinds]
    huge = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("AnonHugePages"))
    print(f"{sys.argv[1]}, {torch.get_num_threads()} threads; {' '.join(huge.split())}")
    for rows in rows_list:
        x, h = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 1536, dtype=dtype)
        times: list[list[float]] = [[] for _ in builds]
        for i in range(10):
            for k in range(len(builds)):
                which = (i + k) % len(builds)
                start = time.perf_counter()
                step(builds[which], x, h)
                times[which].append(time.perf_counter() - start)
        small = statistics.median(times[0] + times[3]) * 1e3
        large = statistics.median(times[1] + times[2]) * 1e3
        copies = " ".join(f"{statistics.median(t) * 1e3:.2f}" for t in times)
        print(f"rows {rows:3d}: 4 KB pages {small:6.2f} ms  2 MB pages {large:6.2f} ms  2M/4K {large / small:.3f}"
              f"  (copies 4K 2M 2M 4K: {copies})")
    del spare


if __name__ == "__main__":
    main()
