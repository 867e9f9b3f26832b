"""ms a decode step spends in SmolLM2-135M's linear layers: 120 calls over 30 distinct layers (fused qkv, o,
gate_up, down; the weights stream from memory as in the model) and the lm_head, oneDNN's prepacked matmul
against paged's packed loop, medians of 7 alternating steps per row count.

    PYTHONPATH=<tree> python experiments/results/bench-vs-vllm/issue47-packed/layers.py float32|bfloat16 1 4 32 ...

On a tree before the packed loop (7963a11) only bf16 has a loop (`paged.kernels.bf16_linear`).
"""

from __future__ import annotations

import sys
import time

import torch

try:
    from paged.kernels.packed_linear import PackedLinear as Loop
    TREE = "new"
except ImportError:
    from paged.kernels.bf16_linear import PackedBf16 as Loop
    TREE = "old"

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def main() -> None:
    dtype = getattr(torch, sys.argv[1])
    torch.manual_seed(0)
    weights = [torch.randn(o, i).to(dtype) * 0.05 for o, i in SHAPES]
    head = torch.randn(49152, 576).to(dtype) * 0.05
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in [*weights, head]]
    has_loop = TREE == "new" or dtype == torch.bfloat16
    loops = [Loop(w) for w in [*weights, head]] if has_loop else []

    def step(rows: int, kind: str) -> tuple[float, float]:
        xs = {576: torch.randn(rows, 576).to(dtype), 1536: torch.randn(rows, 1536).to(dtype)}
        times = []
        for j, (_, i) in enumerate([*SHAPES, (49152, 576)]):
            start = time.perf_counter()
            if kind == "onednn":
                torch.ops.mkldnn._linear_pointwise(xs[i], onednn[j], None, "none", [], "")
            else:
                loops[j](xs[i])
            times.append(time.perf_counter() - start)
        return sum(times[:-1]) * 1e3, times[-1] * 1e3

    kinds = ["onednn", "loop"] if has_loop else ["onednn"]
    for rows in map(int, sys.argv[2:]):
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for _ in range(7):
            for kind in kinds:
                runs[kind].append(step(rows, kind))
        print(TREE, sys.argv[1], rows, "  ".join(
            f"{k}: layers {sorted(a for a, _ in v)[3]:.2f} head {sorted(b for _, b in v)[3]:.2f}"
            for k, v in runs.items()), flush=True)


if __name__ == "__main__":
    main()
