"""KV groups per layer type: per-group tables from one shared pool (`KVGroupManager`), the Gemma
spec models, and the engine with `allocator.kv_groups` auto vs single."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine
from paged.experiment.run import run_experiment
from paged.kv_layout import KVLayout
from paged.memory import AllocStatus, BlockManager, NaiveAllocator, PrefixCachingAllocator
from paged.memory.hashing import prompt_block_hashes
from paged.memory.kv_groups import KVGroupManager
from paged.model.spec import ModelSpec
from paged.request import Request, SamplingParams, Sequence
from paged.sim.cost_model import step_shape
from paged.step import ScheduledSeq, SchedulerOutput
from tests.hypothesis_budget import examples

BS = 4
WINDOW = 8  # tokens: two blocks
# layer 0 slides, layer 1 attends to everything: two groups of one layer each
LAYOUT = KVLayout.build([WINDOW, None])
QUIET = ["logger=none", "progress=false"]


def make_seq(tokens: list[int], max_tokens: int = 64) -> Sequence:
    return Request("r", tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens)).seqs[0]


def manager(num_blocks: int = 64, cls=PrefixCachingAllocator, watermark: float = 0.0) -> KVGroupManager:
    return KVGroupManager(cls(num_blocks=num_blocks, block_size=BS), LAYOUT, watermark)


def prefill(bm: KVGroupManager, seq: Sequence) -> None:
    seq.num_computed_tokens = bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def decode(bm: KVGroupManager, seq: Sequence, token: int = 7) -> list[tuple[int, int]]:
    """One generated token: append it, grow every table, compute it."""
    seq.token_ids.append(token)
    copies = bm.append_slots(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    return copies


def live(table: list[int], bm: KVGroupManager) -> list[int]:
    return [b for b in table if bm.allocator.refcount(b) > 0]


def test_a_windowed_group_frees_what_leaves_its_window_and_the_full_group_keeps_its_blocks():
    bm = manager()
    seq = make_seq(list(range(20)))  # 5 blocks
    prefill(bm, seq)
    windowed, full = bm.group_tables(seq)
    assert len(windowed) == len(full) == 5 and bm.allocator.num_free_blocks == 64 - 10
    for _ in range(12):
        decode(bm, seq)
    windowed, full = bm.group_tables(seq)
    # 32 tokens, 8 blocks: the full group holds all of them, the windowed one only its last window's
    assert len(live(full, bm)) == 8
    first_query = seq.num_computed_tokens - 1
    assert len(live(windowed, bm)) == 8 - (first_query - WINDOW + 1) // BS
    assert bm.block_table(seq) is windowed  # group 0's
    stats = bm.stats()
    assert stats.num_allocated_blocks == len(live(windowed, bm)) + 8
    assert stats.tokens_held == 32  # the full group's tokens, each once


def test_admission_counts_every_groups_table_against_the_shared_pool():
    bm = manager(num_blocks=10)
    assert bm.admission_blocks(make_seq(list(range(20)))) == 10  # 5 blocks in each of 2 groups
    assert bm.can_allocate(make_seq(list(range(20)))) is AllocStatus.OK
    assert bm.can_allocate(make_seq(list(range(21)))) is AllocStatus.NEVER  # 12 blocks
    prefill(bm, make_seq(list(range(100, 108))))  # 2 blocks in each group
    assert bm.can_allocate(make_seq(list(range(200, 212)))) is AllocStatus.OK  # 6 of the 6 free
    assert bm.can_allocate(make_seq(list(range(200, 213)))) is AllocStatus.LATER
    with_watermark = manager(num_blocks=10, watermark=0.2)
    assert with_watermark.can_allocate(make_seq(list(range(16)))) is AllocStatus.OK  # 8 leave 2
    assert with_watermark.can_allocate(make_seq(list(range(17)))) is AllocStatus.NEVER


def test_growth_is_all_groups_or_none():
    bm = manager(num_blocks=4)
    seq = make_seq(list(range(4)))  # one block each
    prefill(bm, seq)
    other = make_seq(list(range(50, 54)))
    prefill(bm, other)  # the pool is full
    seq.token_ids.append(1)
    assert bm.try_append_slots(seq) is None and not bm.can_append_slots(seq)
    assert [len(t) for t in bm.group_tables(seq)] == [1, 1]  # neither group grew
    bm.free(other)
    assert bm.try_append_slots(seq) == [] and [len(t) for t in bm.group_tables(seq)] == [2, 2]


def test_prefix_hits_are_the_longest_prefix_every_group_has_cached():
    bm = manager(num_blocks=24)
    prompt = list(range(16))  # 4 full blocks
    first = make_seq(prompt + [99])
    prefill(bm, first)
    second = make_seq(prompt + [98])
    assert bm.num_cached_tokens(second) == 16
    assert bm.allocate(second) == 16
    # the hits are each group's own blocks: groups never share a block
    for mine, theirs in zip(bm.group_tables(first), bm.group_tables(second), strict=True):
        assert mine[:4] == theirs[:4]
    assert not set(bm.group_tables(first)[0]) & set(bm.group_tables(first)[1])
    bm.free(first)
    bm.free(second)
    # evict the windowed group's cached blocks from block 1 on (a chain's tail goes first): the
    # full group still has all 4, the common prefix is 1 block
    pool, third = bm.allocator, make_seq(prompt + [97])
    taken = []
    while len(bm.groups[0].prefix_index.own_hits(third)) > 1:
        taken.append(pool.allocate())
    assert len(bm.groups[1].prefix_index.own_hits(third)) == 4
    assert bm.num_cached_tokens(third) == 4
    for b in taken:
        pool.free(b)
    assert bm.allocate(third) == 4


def test_group_0_keeps_todays_hashes_and_other_groups_key_theirs_apart():
    single = BlockManager(PrefixCachingAllocator(num_blocks=16, block_size=BS), 0.0)
    bm = manager(num_blocks=16)
    for m in (single, bm):
        seq = make_seq(list(range(9)))
        seq.num_computed_tokens = m.allocate(seq)
        seq.num_computed_tokens = seq.num_tokens
        m.mark_computed(seq)
    chain = prompt_block_hashes(list(range(9)), BS)  # what a router computes
    assert single.prefix_index.cached_blocks(chain) == bm.prefix_index.cached_blocks(chain) == 2
    windowed, full = bm.group_tables(seq)
    assert bm.allocator.peek(chain[0]) == windowed[0] != full[0]


def test_fork_shares_every_groups_blocks_and_free_returns_them_all():
    bm = manager(num_blocks=32, cls=NaiveAllocator)
    parent = make_seq(list(range(6)))
    prefill(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    for table in bm.group_tables(parent):
        assert all(bm.allocator.refcount(b) == 2 for b in table)
    copies = decode(bm, child)
    assert len(copies) == 2  # the shared last block copied once per group
    bm.free(parent)
    bm.free(child)
    assert bm.allocator.num_free_blocks == 32
    assert bm.stats().num_token_slots_used == 0 and bm.stats().num_logical_blocks == 0


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 10_000))
def test_random_interleavings_never_over_commit_the_shared_pool(seed):
    """Admit, grow, fork and free at random; every table's blocks are live and distinct between
    sequences unless shared, and the pool's free count matches what the tables hold."""
    rng = random.Random(seed)
    bm = manager(num_blocks=40)
    running: list[Sequence] = []
    for _ in range(120):
        action = rng.random()
        if action < 0.3:
            seq = make_seq([rng.randrange(3) for _ in range(rng.randrange(1, 20))])
            if bm.can_allocate(seq) is AllocStatus.OK:
                prefill(bm, seq)
                running.append(seq)
        elif action < 0.8 and running:
            seq = rng.choice(running)
            seq.token_ids.append(rng.randrange(3))
            if bm.try_append_slots(seq) is None:
                seq.token_ids.pop()
            else:
                seq.num_computed_tokens = seq.num_tokens
                bm.mark_computed(seq)
        elif action < 0.87 and running:
            parent = rng.choice(running)
            child = parent.fork(1)
            bm.fork(parent, child)
            running.append(child)
        elif running:
            seq = running.pop(rng.randrange(len(running)))
            bm.free(seq)
        held: dict[int, int] = {}
        for seq in running:
            for g, table in zip(bm.groups, bm.group_tables(seq), strict=True):
                first_live = g._seqs[seq.seq_id].num_dropped  # noqa: SLF001 - the invariant's own bookkeeping
                for b in table[first_live:]:
                    held[b] = held.get(b, 0) + 1
        assert all(bm.allocator.refcount(b) == n for b, n in held.items())
        assert bm.allocator.num_free_blocks == 40 - len(held)
    for seq in running:
        bm.free(seq)
    assert bm.allocator.num_free_blocks == 40


# -- spec models and the simulator ------------------------------------------------------------------


def test_gemma_spec_models_have_their_layer_types_and_size():
    gemma3 = build_engine(compose_config(["executor=sim", *QUIET, "model=gemma-3-27b", "hardware=h100-sxm"]))
    windows = gemma3.executor.layer_windows
    assert len(windows) == 62 and windows.count(None) == 10 and windows[5] is None and windows[0] == 1024
    layout = gemma3.executor.kv_layout
    assert layout.num_slots == 10 and layout.num_groups == 7  # 52 sliding layers in 6 groups of 10, 1 full
    # a block holds 10 layers' K and V: 16 KV heads x 128 x 2 bytes x 2 x 16 tokens x 10
    assert gemma3.executor.kv_cache_spec(16).bytes_per_block == 16 * 128 * 2 * 2 * 16 * 10
    assert isinstance(gemma3.scheduler.block_manager, KVGroupManager)
    spec = gemma3.executor.spec
    assert 26e9 < spec.num_params < 29e9  # "27B"
    gemma2 = build_engine(compose_config(["executor=sim", *QUIET, "model=gemma-2-27b", "hardware=h100-sxm"]))
    assert gemma2.executor.layer_windows[:2] == (4096, None) and gemma2.executor.kv_layout.num_groups == 2
    assert 26e9 < gemma2.executor.spec.num_params < 29e9


def test_layer_types_are_validated():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                head_dim=4)
    with pytest.raises(ValueError, match="sliding_window must be set"):
        ModelSpec("m", **base, sliding_window_pattern=2)
    with pytest.raises(ValueError, match="layer_types must name"):
        ModelSpec("m", **base, sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="both give"):
        ModelSpec("m", **base, sliding_window=4, sliding_window_pattern=2, layer_types=("full_attention",) * 2)
    spec = ModelSpec("m", **base, sliding_window=4, layer_types=["full_attention", "sliding_attention"])
    assert spec.layer_windows == (None, 4)


def test_attention_is_costed_per_layer_type():
    """A long decode on Gemma-3: its sliding layers read 1024 tokens, its full ones the whole
    context, so attention costs far less than if every layer read everything."""
    engine = build_engine(compose_config(["executor=sim", *QUIET, "model=gemma-3-27b", "hardware=h100-sxm"]))
    executor = engine.executor
    seq = make_seq(list(range(16000)))
    seq.num_computed_tokens = 15999
    sched = SchedulerOutput([ScheduledSeq(seq, 1, [])])
    executor.execute(sched)
    hybrid = executor.last_cost.attention_s
    full = executor.cost_model.step(step_shape(sched, 16, None)).attention_s
    sliding = executor.cost_model.step(step_shape(sched, 16, 1024)).attention_s
    assert hybrid == pytest.approx(full * 10 / 62 + sliding * 52 / 62)
    assert hybrid < 0.5 * full


# -- the engine ------------------------------------------------------------------------------------


def _gemma_run(tmp_path, mode: str, *overrides: str) -> dict:
    cfg = compose_config([
        "executor=sim", *QUIET, "model=gemma-3-27b", "hardware=h100-sxm", f"allocator.kv_groups={mode}",
        "workload=fixed", "workload.num_requests=24", "workload.prompt_len=3000", "workload.output_len=256",
        "scheduler.max_model_len=4096", "scheduler.max_num_seqs=128", *overrides,
    ])
    return run_experiment(cfg, tmp_path / mode)


def test_hybrid_groups_hold_more_tokens_and_batch_more_than_one_group(tmp_path):
    single, auto = _gemma_run(tmp_path, "single"), _gemma_run(tmp_path, "auto")
    assert (single["num_kv_groups"], auto["num_kv_groups"]) == (1, 7)
    assert single["kv_cache_bytes"] == pytest.approx(auto["kv_cache_bytes"], rel=1e-3)
    assert auto["num_finished"] == single["num_finished"] == 24
    assert auto["kv_bytes_per_token_mean"] < single["kv_bytes_per_token_mean"] / 1.5
    assert auto["mean_decode_batch_size"] > single["mean_decode_batch_size"]


def test_one_group_is_todays_block_manager():
    engine = build_engine(compose_config(["executor=sim", *QUIET, "model=llama-3-8b"]))
    assert type(engine.scheduler.block_manager) is BlockManager
    assert engine.executor.kv_layout.num_groups == 1 and engine.executor.kv_layout.num_slots == 32


def test_bad_kv_groups_and_swap_with_groups_are_one_line_errors():
    with pytest.raises(ConfigError, match="allocator.kv_groups='per-layer' is not supported; allowed: auto, single"):
        build_engine(compose_config(["executor=sim", *QUIET, "allocator.kv_groups=per-layer"]))
    with pytest.raises(ConfigError, match="cannot swap"):
        build_engine(compose_config(["executor=sim", *QUIET, "model=gemma-3-27b", "scheduler.preemption_mode=swap"]))
    # single keeps today's layout, which swaps
    build_engine(compose_config(["executor=sim", *QUIET, "model=gemma-3-27b", "scheduler.preemption_mode=swap",
                                 "allocator.kv_groups=single", "hardware=h100-sxm"]))


def test_tiny_hybrid_greedy_outputs_are_the_same_with_groups_and_one_table(tmp_path):
    """The real model (H3's tiny-hybrid: windowed and full layers) with long enough prompts and
    outputs to cross its window: groups free blocks, the tokens stay the same."""
    outputs = {}
    for mode in ("auto", "single"):
        cfg = compose_config([
            *QUIET, "model=tiny-hybrid", "workload=fixed", "workload.num_requests=4", "workload.prompt_len=40",
            "workload.output_len=40", "workload.shared_prefix_len=16", "allocator.num_blocks=64",
            f"allocator.kv_groups={mode}", "scheduler.max_model_len=128",
        ])
        engine = build_engine(cfg)
        assert engine.executor.kv_layout.num_groups == (1 if mode == "single" else 3)  # full, 2 x windowed
        run_experiment(cfg, tmp_path / mode, name=mode)
        lines = (tmp_path / mode / "requests.jsonl").read_text().splitlines()
        outputs[mode] = [json.loads(line)["output_token_ids"] for line in lines]
    assert outputs["auto"] == outputs["single"]


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["scheduler.preemption_mode=swap"], "cannot swap"),
    (["allocator=orca-max"], "hands out contiguous extents"),
    (["allocator=prefix", "allocator.offload.cpu_bytes=1MiB"], "allocator.offload is not supported with several KV"),
])
def test_what_groups_cannot_do_is_refused_before_any_weights_load(monkeypatch, overrides, fragment):
    def refuse(*_, **__):
        raise AssertionError("weights were loaded before the config error")

    monkeypatch.setattr("paged.executor.model_executor.load_weights", refuse)
    with pytest.raises(ConfigError, match=fragment) as e:
        build_engine(compose_config([*QUIET, "model=tiny-hybrid", *overrides]))
    assert "\n" not in str(e.value)
