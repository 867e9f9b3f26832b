"""Ahead-of-time NVRTC build of every kernel instantiation the dispatcher can pick; needs no GPU.

    python -m paged.kernels.toolchain.build --arch sm_90 [--report] [--default-only] [--partition-size 512]

Fills the cubin cache (`$PAGED_CACHE_DIR`, default ~/.cache/paged) so later runs start warm.
`--report` prints registers, spills, static shared memory and compile time per kernel.
"""

from __future__ import annotations

import argparse
import sys
import time

from paged.kernels.limits import DEFAULT_PARTITION_SIZE
from paged.kernels.toolchain import nvrtc, specs


def format_report(compiled: list[nvrtc.CompiledUnit]) -> str:
    """One row per kernel; compile time is that of the unit (one NVRTC program) it belongs to."""
    header = f"{'kernel':<72} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'smem B':>7} {'compile s':>10}"
    rows = [header, "-" * len(header)]
    for unit in compiled:
        for info in unit.infos:
            rows.append(
                f"{info.kernel:<72} {info.registers:>5} {info.spill_stores:>9} {info.spill_loads:>9} "
                f"{info.static_smem:>7} {unit.compile_s:>10.2f}"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged.kernels.toolchain.build", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--arch", required=True, help="target, e.g. sm_80 or sm_90")
    parser.add_argument("--report", action="store_true", help="print per-kernel resource use")
    parser.add_argument("--default-only", action="store_true", help="only fp16/bf16, head 128, block 16")
    parser.add_argument("--partition-size", type=int, default=DEFAULT_PARTITION_SIZE)
    parser.add_argument("--no-cache", action="store_true", help="recompile even when cached")
    parser.add_argument("--jobs", type=int, default=None, help="parallel NVRTC compiles (default: CPU count)")
    args = parser.parse_args(argv)

    try:
        nvrtc.toolchain()
        supported = nvrtc.supported_archs()
    except nvrtc.NVRTCUnavailableError as e:
        print(e, file=sys.stderr)
        return 2
    if args.arch not in supported:
        print(f"--arch {args.arch} is not supported by this NVRTC; supported: {', '.join(supported)}", file=sys.stderr)
        return 2
    units = specs.default_units() if args.default_only else specs.dispatchable_units(args.partition_size)
    start = time.perf_counter()
    compiled = nvrtc.compile_units(units, args.arch, jobs=args.jobs, use_cache=not args.no_cache)
    elapsed = time.perf_counter() - start
    if args.report:
        print(format_report(compiled))
    fresh = sum(not c.cached for c in compiled)
    spilling = sum(1 for c in compiled for i in c.infos if i.spill_stores or i.spill_loads)
    print(f"{len(compiled)} units ({sum(len(c.unit.kernels) for c in compiled)} kernels) for {args.arch}: "
          f"{fresh} compiled, {len(compiled) - fresh} from cache, {elapsed:.2f} s; {spilling} kernels spill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
