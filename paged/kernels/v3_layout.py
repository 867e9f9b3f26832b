"""v3 decode's CTA on a device (kernels_cu/decode_v3.cuh's V3Layout): its shared memory, the depth
of its K/V pipeline, and how many CTAs one SM holds at once.

The pipeline's depth is a template argument of the kernel, chosen here per device and cache: the
deepest that still leaves every SM the CTAs its threads and registers allow, and never shallower
than the fixed depth v3 had before (3 stages of up to 16 KB, else 2), so no plan keeps fewer CTAs
or fewer bytes in flight per CTA than it did. A K/V stage of 16-bit head-128 tiles is 16 KB, so an
H100 or H200 SM (228 KB, 4 CTAs by registers) holds 3 of them per CTA, as before; an fp8 or
head-64 stage is half that, and the same shared memory holds 6 (3 before). Loads in flight are what
a decode kernel's speed is made of on HBM3e (issue 44: v3 reached 88% of the read probe on an H100
and 74-77% on an H200, where the same CTAs must keep 1.45x the bytes in flight), and with 3 stages
an fp8 CTA kept half the bytes of a 16-bit one in flight. Whether the deeper pipelines pay is
measured by `experiments/gpu/kernel_bench.py --v3-stages`.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.kernels.split_plan import TILE_TOKENS, Hardware

V3_WARPS = 4
V3_THREADS = 32 * V3_WARPS
V3_WARP_KEYS = TILE_TOKENS // V3_WARPS
V3_TABLE_CHUNK = 128
# Shared memory the driver keeps per CTA on sm_80 and newer, on top of what the kernel asks for.
RESERVED_SHARED_MEMORY = 1024
# Registers per thread of the main kernel as NVRTC allocates them for fp16, head 128, a group of 8
# on sm_90 (110 on tensor cores; the CUDA-core path of fp32 at head 256 takes 240): the plan is
# made before the kernel is loaded.
V3_REGISTERS = 110
# K/V stages of the pipeline: two at least (one tile computed while the next loads); eight at most,
# past which one CTA's loads in flight (7 tiles) exceed what an SM's share of HBM bandwidth needs.
MIN_STAGES, MAX_STAGES = 2, 8


@dataclass(frozen=True)
class DeviceLimits:
    """What an occupancy estimate needs of a device."""

    multiprocessors: int
    shared_memory_per_multiprocessor: int
    threads_per_multiprocessor: int
    registers_per_multiprocessor: int = 65536


# An H100 SXM's SMs, shared memory and threads per SM: the device the emulator plans for, and the
# one whose stage counts the ahead-of-time unit lists compile.
H100 = DeviceLimits(multiprocessors=132, shared_memory_per_multiprocessor=228 * 1024, threads_per_multiprocessor=2048)


def v3_fixed_shared_memory(head_size: int, tile: int) -> int:
    """The CTA's shared memory before its K/V stages: the pre-scaled query, a table chunk, and the
    warps' probabilities and softmax states."""
    return tile * head_size * 4 + V3_TABLE_CHUNK * 4 + V3_WARPS * tile * V3_WARP_KEYS * 4 + 2 * V3_WARPS * tile * 4


def v3_stage_bytes(cache_element_size: int, head_size: int) -> int:
    """One stage of the pipeline: a K and a V tile of `TILE_TOKENS` keys."""
    return 2 * TILE_TOKENS * head_size * cache_element_size


def v3_shared_memory(cache_element_size: int, head_size: int, tile: int, stages: int) -> int:
    """V3Layout::BYTES: the fixed part, then `stages` K/V stages."""
    return v3_fixed_shared_memory(head_size, tile) + stages * v3_stage_bytes(cache_element_size, head_size)


def hardware(limits: DeviceLimits, shared_memory: int, registers: int = V3_REGISTERS) -> Hardware:
    """The device's SMs and the v3 CTAs each holds at once: the fewest its threads, shared memory
    and registers allow (an H100 holds 4 at fp16, head 128, a group of 8: 53 KB of shared memory
    each)."""
    by_smem = limits.shared_memory_per_multiprocessor // (shared_memory + RESERVED_SHARED_MEMORY)
    return Hardware(limits.multiprocessors, max(min(_ctas_without_shared_memory(limits, registers), by_smem), 1))


def v3_stages(limits: DeviceLimits, cache_element_size: int, head_size: int, tile: int,
              registers: int = V3_REGISTERS) -> int:
    """The deepest pipeline (up to MAX_STAGES) whose shared memory keeps the CTAs per SM that
    threads and registers allow, and at least the former fixed depth (`base_stages`)."""
    stage = v3_stage_bytes(cache_element_size, head_size)
    share = limits.shared_memory_per_multiprocessor // _ctas_without_shared_memory(limits, registers)
    room = share - RESERVED_SHARED_MEMORY - v3_fixed_shared_memory(head_size, tile)
    return min(max(room // stage, base_stages(cache_element_size, head_size)), MAX_STAGES)


def base_stages(cache_element_size: int, head_size: int) -> int:
    """v3's depth before it was planned per device: 3 stages of up to 16 KB, else 2."""
    return 3 if v3_stage_bytes(cache_element_size, head_size) <= 16384 else MIN_STAGES


def check_stages(stages: int) -> None:
    """A forced stage count (a benchmark sweeping it) must be one the kernel is built for."""
    if not MIN_STAGES <= stages <= MAX_STAGES:
        raise ValueError(f"num_stages={stages} is not a v3 pipeline depth; allowed: {MIN_STAGES}..{MAX_STAGES}")


def _ctas_without_shared_memory(limits: DeviceLimits, registers: int) -> int:
    by_threads = limits.threads_per_multiprocessor // V3_THREADS
    by_registers = limits.registers_per_multiprocessor // (registers * V3_THREADS)
    return max(min(by_threads, by_registers), 1)
