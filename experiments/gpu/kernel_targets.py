"""The v3 decode kernel's targets, checked on experiments/gpu/kernel_bench.py's results where their rows were
measured (a target whose rows were not is listed as such, with the flags that measure it):

- v3 at >= 90% of the read probe at 64x4096 and 256x1024, >= 60% at 1x16384 and >= 40% at 1x4096
  (GQA 8, fp16; issue 44, on H100 and H200 alike; issue 29 asked 75% of the first two);
- v3 at least as fast as cuDNN's SDPA (sdpa-cudnn µs / v3 µs >= 1) at 64x4096 and 256x1024: ours
  reads a paged cache, theirs contiguous K/V (issue 44);
- v3 in bf16 within 5% of fp16 (bf16 µs <= 1.05 x fp16 µs) at 64x4096, 256x1024 and 1x16384;
- v3 with an fp8 (e4m3) cache >= 1.6x faster than with fp16 at 64x4096;
- v3 at >= 0.9x FlashInfer's speed (FlashInfer µs / v3 µs >= 0.9) on every row where both ran.
"""

from __future__ import annotations

import torch
from kernel_inputs import kv_bytes
from kernel_timing import Timing

# (batch, context, dtype label, kv label) -> kernel name -> timing, as kernel_bench.Bench keeps them
Results = dict[tuple[int, int, str, str], dict[str, Timing | None]]
BANDWIDTH_TARGETS = (((64, 4096), 90.0), ((256, 1024), 90.0), ((1, 16384), 60.0), ((1, 4096), 40.0))
# the rows where v3 must match sdpa-cudnn, and where bf16 must stay within 5% of fp16
CUDNN_SHAPES = ((64, 4096), (256, 1024))
BF16_SHAPES = ((64, 4096), (256, 1024), (1, 16384))


def _v3(results: Results, shape: tuple[int, int], dtype: str, kv: str = "=") -> Timing | None:
    return results.get((*shape, dtype, kv), {}).get("v3")


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def check_targets(results: Results, read_bandwidth: float) -> list[str]:
    """One line per target: measured value, the target, met or not, or what would measure it."""
    lines = ["targets of the v3 kernel (from measured rows only):"]
    for (batch, context), target in BANDWIDTH_TARGETS:
        t = _v3(results, (batch, context), "fp16")
        what = f"v3 {batch}x{context} fp16 >= {target:.0f}% of the read probe"
        if t is None:
            lines.append(f"  {what}: not measured (--shapes {batch}x{context} --dtype float16)")
            continue
        pct = 100 * kv_bytes(batch, context, torch.float16) / (t.us * 1e-6) / read_bandwidth
        lines.append(f"  {what}: {pct:.0f}%, {_verdict(pct >= target)}")
    for shape in CUDNN_SHAPES:
        v3 = _v3(results, shape, "fp16")
        cudnn = results.get((*shape, "fp16", "="), {}).get("sdpa-cudnn")
        what = f"v3 {shape[0]}x{shape[1]} fp16 >= sdpa-cudnn's speed"
        if v3 is None or cudnn is None:
            lines.append(f"  {what}: not measured (--shapes {shape[0]}x{shape[1]} --dtype float16 --peers sdpa-cudnn)")
            continue
        lines.append(f"  {what}: sdpa-cudnn / v3 = {cudnn.us / v3.us:.2f}, {_verdict(cudnn.us >= v3.us)}")
    for shape in BF16_SHAPES:
        fp16, bf16 = _v3(results, shape, "fp16"), _v3(results, shape, "bf16")
        what = f"v3 {shape[0]}x{shape[1]} bf16 within 5% of fp16"
        if fp16 is None or bf16 is None:
            lines.append(f"  {what}: not measured (--dtype float16 bfloat16)")
            continue
        lines.append(f"  {what}: bf16 / fp16 = {bf16.us / fp16.us:.2f}, {_verdict(bf16.us <= 1.05 * fp16.us)}")
    fp16, fp8 = _v3(results, (64, 4096), "fp16"), _v3(results, (64, 4096), "fp16", "e4m3")
    what = "v3 64x4096 fp8 e4m3 cache >= 1.6x faster than fp16"
    if fp16 is None or fp8 is None:
        lines.append(f"  {what}: not measured (--kv-cache-dtype auto fp8_e4m3)")
    else:
        lines.append(f"  {what}: {fp16.us / fp8.us:.2f}x, {_verdict(fp16.us >= 1.6 * fp8.us)}")
    ratios = {key: row["flashinfer"].us / row["v3"].us for key, row in results.items()
              if row.get("v3") is not None and row.get("flashinfer") is not None}
    what = "v3 >= 0.9x FlashInfer's speed on every row both ran"
    if not ratios:
        lines.append(f"  {what}: not measured (FlashInfer not built or v3 not run)")
    else:
        worst = min(ratios, key=ratios.__getitem__)
        lines.append(f"  {what}: {sum(r >= 0.9 for r in ratios.values())} of {len(ratios)} rows; lowest "
                     f"{ratios[worst]:.2f} at {worst[0]}x{worst[1]} {worst[2]} kv {worst[3]}, "
                     f"{_verdict(min(ratios.values()) >= 0.9)}")
    return lines
