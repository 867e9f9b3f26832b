"""Tiers for evicted prefix blocks (`allocator.offload`): the memory layer's bookkeeping, the disk
tier's files, the engine on tiny-random (outputs identical with the tiers on and off, hits counted
per tier, corrupt / missing files and a full disk), the bad-input one-liners and the simulator's price."""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path

import pytest
import torch

import paged.executor.tier_files as tier_files
from paged import LLM, SamplingParams
from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import drive
from paged.executor.tier_files import TierFiles
from paged.experiment.summary import summarize
from paged.memory.eviction import LRUPolicy
from paged.memory.kv_tiers import KVTiers
from paged.memory.tier_pool import TierPool
from paged.request import Request
from paged.sim.cost_model import step_shape
from paged.sim.tier_disk import SimTierDisk
from paged.step import SchedulerOutput

BLOCK_BYTES = 16384  # one tiny-random block: 2 layers x K/V x 1 head x 64 x 16 tokens x fp32


# -- the memory layer -----------------------------------------------------------------------------


def host_pool(num_blocks: int) -> list[torch.Tensor]:
    return [torch.zeros(num_blocks, 2, 8) for _ in range(4)]


def test_a_full_cpu_tier_spills_its_victim_to_disk_and_reads_it_back_verified(tmp_path: Path) -> None:
    pool = host_pool(4)
    store = TierFiles(lambda: pool, torch.device("cpu"), str(tmp_path))
    tiers = KVTiers(TierPool("cpu", 2, LRUPolicy()), host_offset=2, disk=TierPool("disk", 4, LRUPolicy()), store=store)
    hashes = [bytes([i]) * 16 for i in range(3)]
    for device_block, h in enumerate(hashes[:2]):
        tiers.offload(device_block, h, device_block)
    assert tiers.take_moves() == ([(0, 2), (1, 3)], [])
    for host_block in (2, 3):  # what the executor's offloads wrote
        for t in pool:
            t[host_block] = host_block
    tiers.offload(5, hashes[2], 2)  # the CPU tier is full: its least recent entry goes to disk
    offloads, _ = tiers.take_moves()
    assert offloads == [(5, 2)] and tiers.num_disk_writes == 1
    for t in pool:
        t[2] = -1  # the offload overwrote the spilled host block
    assert tiers.holds(hashes[0]) and tiers.cpu.slot(hashes[0]) is None
    assert tiers.hold([hashes[0]]) == 1
    assert tiers.onload(hashes[0], device_block=7) == "disk"
    _, onloads = tiers.take_moves()
    (host_block, device_block), = onloads
    assert device_block == 7 and all((t[host_block] == 2).all() for t in pool)
    assert tiers.hit_blocks == {"cpu": 0, "disk": 1} and tiers.num_disk_reads == 1
    store.close()
    assert not store.folder.exists()


@pytest.mark.parametrize("damage", ["corrupt", "missing", "other block"])
def test_a_bad_disk_file_is_a_miss_and_leaves_the_host_block_alone(tmp_path: Path, damage: str) -> None:
    pool = host_pool(2)
    for t in pool:
        t[0] = 3.0
    store = TierFiles(lambda: pool, torch.device("cpu"), str(tmp_path))
    block_hash = b"h" * 16
    store.spill(0, block_hash, disk_slot=5)
    store.flush()
    path = store.path(5)
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "missing":
        path.unlink()
    else:
        block_hash = b"g" * 16
    assert not store.load(5, block_hash, host_block=1)
    assert all((t[1] == 0).all() for t in pool)
    assert store.load(5, b"h" * 16, host_block=1) == (damage == "other block")
    store.close()


def test_pinned_entries_are_never_evicted_and_a_full_pinned_tier_drops_the_block() -> None:
    tiers = KVTiers(TierPool("cpu", 1, LRUPolicy()))
    tiers.offload(0, b"a" * 16, 0)
    tiers.offload(1, b"b" * 16, 0)  # the only slot is pinned by this step's copy: b is lost
    assert tiers.take_moves() == ([(0, 0)], []) and not tiers.holds(b"b" * 16)
    tiers.offload(1, b"b" * 16, 0)
    assert tiers.take_moves() == ([(1, 0)], []) and not tiers.holds(b"a" * 16)


# -- the engine on tiny-random --------------------------------------------------------------------

rng = random.Random(0)
PREFIXES = [[rng.randrange(1000, 30000) for _ in range(64)] for _ in range(4)]  # four blocks each
ROUNDS = [[p + [rng.randrange(1000, 30000) for _ in range(8)] for p in PREFIXES] for _ in range(2)]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)


def run(*overrides: str, between=None) -> tuple[list[list[int]], LLM]:
    """Every prompt of round one, then of round two (the same prefixes), one at a time on a pool
    holding two prompts: round two's prefixes were evicted from the device. `between(llm)` runs
    before each prompt of round two."""
    llm = LLM("tiny-random", overrides=["model.device=cpu", "allocator.num_blocks=12", *overrides])
    outs = []
    for i, prompts in enumerate(ROUNDS):
        for prompt in prompts:
            if i and between is not None:
                between(llm)
            outs.append(llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
    return outs, llm


@pytest.fixture(scope="module")
def tiers_off() -> list[list[int]]:
    outs, llm = run()
    assert llm.engine.kv_stats().num_hit_tokens_cpu == 0
    return outs


def tier_store(llm: LLM) -> TierFiles:
    store = llm.engine.scheduler.block_manager.prefix_index.tiers.store
    store.flush()
    return store


def test_an_evicted_prefix_comes_back_from_the_cpu_tier(tiers_off: list[list[int]]) -> None:
    outs, llm = run("allocator.offload.cpu_bytes=4MiB")
    kv = llm.engine.kv_stats()
    assert outs == tiers_off
    # round two hits every prefix block in the CPU tier
    assert kv.num_hit_tokens_cpu == 4 * 64 and kv.num_onload_blocks == 4 * 4 and kv.num_offload_blocks > 0


def test_a_prefix_spilled_to_disk_comes_back(tmp_path: Path, tiers_off: list[list[int]]) -> None:
    outs, llm = run("allocator.offload.cpu_bytes=128KiB", f"allocator.offload.disk_path={tmp_path}",
                    "allocator.offload.disk_bytes=1MiB")
    kv = llm.engine.kv_stats()
    assert outs == tiers_off
    assert kv.num_hit_tokens_disk > 0 and kv.num_disk_read_blocks > 0 and kv.num_disk_bad_blocks == 0
    folder = tier_store(llm).folder
    assert folder.parent == tmp_path and any(folder.iterdir())


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_corrupt_or_missing_files_are_misses_with_identical_outputs(
    tmp_path: Path, tiers_off: list[list[int]], damage: str
) -> None:
    def spoil(llm: LLM) -> None:
        for path in tier_store(llm).folder.iterdir():
            if damage == "missing":
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[100] ^= 0xFF
                path.write_bytes(bytes(data))

    outs, llm = run("allocator.offload.cpu_bytes=128KiB", f"allocator.offload.disk_path={tmp_path}",
                    "allocator.offload.disk_bytes=1MiB", between=spoil)
    kv = llm.engine.kv_stats()
    assert outs == tiers_off
    assert kv.num_disk_bad_blocks > 0  # each a miss: the block was recomputed


def test_a_full_disk_turns_the_disk_tier_off_with_one_warning(
    tmp_path: Path, tiers_off: list[list[int]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tier_files, "write_file", full)
    with caplog.at_level(logging.WARNING, logger="paged.memory.kv_tiers"):
        outs, llm = run("allocator.offload.cpu_bytes=128KiB", f"allocator.offload.disk_path={tmp_path}",
                        "allocator.offload.disk_bytes=1MiB", between=tier_store)
    assert outs == tiers_off
    warnings = [r for r in caplog.records if "disk tier is off" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert llm.engine.scheduler.block_manager.prefix_index.tiers.disk is None  # the CPU tier goes on


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (["allocator=naive", "allocator.offload.cpu_bytes=1MiB"], "allocator=naive caches no prefixes"),
    (["allocator.offload.cpu_bytes=1KiB"], "smaller than one KV block (16384 bytes"),
    (["allocator.offload.cpu_bytes=1MiB", "allocator.offload.disk_path=DIR", "allocator.offload.disk_bytes=1KiB"],
     "allocator.offload.disk_bytes='1KiB' is smaller than one KV block"),
    (["allocator.offload.cpu_bytes=1MiB", "allocator.offload.disk_path=DIR/file/sub",
      "allocator.offload.disk_bytes=1MiB"], "is not writable"),
    (["allocator.offload.cpu_bytes=1MiB", "allocator.offload.disk_path=DIR", "allocator.offload.disk_bytes=999999GiB"],
     "bytes free on the disk"),
    (["allocator.offload.disk_path=DIR", "allocator.offload.disk_bytes=1MiB"], "needs a CPU tier above it"),
    (["allocator.offload.cpu_bytes=1MiB", "allocator.offload.disk_path=DIR"], "needs allocator.offload.disk_bytes"),
    (["allocator.offload.cpu_bytes=lots"], "allocator.offload.cpu_bytes='lots' is not a positive size"),
    (["allocator.offload.cpu_bytes=1MiB", "allocator.offload.cpu_eviction=mru"], "is not an eviction policy"),
    (["allocator.offload.cpu_bytes=1MiB", "executor.tensor_parallel_size=2"], "tensor_parallel_size=2"),
])
def test_bad_offload_settings_are_one_line_errors(tmp_path: Path, overrides: list[str], message: str) -> None:
    (tmp_path / "file").write_text("")
    overrides = [o.replace("DIR", str(tmp_path)) for o in overrides]
    with pytest.raises(ConfigError, match="allocator.offload") as e:
        LLM("tiny-random", overrides=["model.device=cpu", "allocator.num_blocks=12", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


# -- the simulator --------------------------------------------------------------------------------


def test_the_simulator_prices_tier_copies_at_pcie_and_disk_reads_at_disk_bandwidth() -> None:
    shape = step_shape(SchedulerOutput(blocks_to_offload=[(0, 1), (2, 3)], blocks_to_onload=[(1, 4)]))
    assert (shape.num_swap_blocks, shape.num_offload_blocks, shape.num_onload_blocks) == (0, 2, 1)
    disk = SimTierDisk(bytes_per_block=7_000_000, disk_bandwidth=7e9)  # a millisecond a block
    disk.spill(0, b"", 0)
    disk.spill(1, b"", 1)
    assert disk.stall_s(compute_s=0.0005) == 0.0  # writes run in the background
    assert disk.load(0, b"", 2)
    # the read waits for the 1.5 ms of writes still queued, then takes its own millisecond
    assert disk.stall_s(compute_s=0.01) == pytest.approx(0.0025)


def test_a_simulated_run_with_a_cpu_tier_reports_its_hits_and_bytes() -> None:
    def sim(*overrides: str) -> dict:
        cfg = compose_config(["executor=sim", "model=tiny-random", "hardware=h100-sxm", "logger=none",
                              "progress=false", "allocator.num_blocks=12", *overrides])
        engine = build_engine(cfg)
        for i, prompt in enumerate(p for r in ROUNDS for p in r):
            engine.add_request(Request(f"r{i}", prompt, PARAMS, arrival_time=i * 1.0))
            drive(engine)
        return summarize(cfg, engine)

    off = sim()
    cpu = sim("allocator.offload.cpu_bytes=4MiB")
    assert off["prefix_hit_tokens_cpu"] == 0 and cpu["prefix_hit_tokens_cpu"] == 4 * 64
    assert cpu["recompute_avoided_tokens"] == 4 * 64 and cpu["kv_onload_bytes"] == 4 * 4 * BLOCK_BYTES
    assert cpu["prefix_cache_hit_rate"] > off["prefix_cache_hit_rate"]
