"""KV compression (`kv_press`): the presses' choices, compaction that frees real blocks, the invariant
(a held token's KV index is its position less the tokens evicted before it; RoPE keeps the original
positions), and end to end on the tiny random model: a compressed run's greedy tokens equal a dense
float64 reference that attends, at every step, to exactly the tokens the press kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from paged import kernels
from paged.config import CONF_DIR, ConfigError, compose_config
from paged.engine.builder import build_engine, check_config
from paged.engine.runner import drive
from paged.executor.model_executor import ModelExecutor
from paged.memory import BlockManager, NaiveAllocator, PrefixCachingAllocator
from paged.memory.compaction import CompactingBlockManager
from paged.memory.press import BlockNormPress, KnormPress, PressView, SinkWindowPress
from paged.request import Request, SamplingParams
from tests.test_executor import make_executor

BS = 16


def held_view(n: int, key_norms: np.ndarray | None = None, value_norms: np.ndarray | None = None) -> PressView:
    return PressView(np.arange(n), n, BS, key_norms, value_norms)


# -- the presses ---------------------------------------------------------------------------------


def test_sink_window_keeps_the_sinks_and_the_latest_tokens() -> None:
    keep = SinkWindowPress(sink=4, max_tokens=40).keep(held_view(100))
    assert keep.tolist() == [0, 1, 2, 3, *range(64, 100)]


def test_a_sequence_within_its_budget_is_untouched() -> None:
    assert SinkWindowPress(sink=4, max_tokens=40).keep(held_view(40)) is None
    assert KnormPress(ratio=2).keep(PressView(np.arange(10), 20, BS, np.zeros(10))) is None  # 10 held of 20: the budget


def test_ratio_budget_counts_the_original_length() -> None:
    press = SinkWindowPress(sink=2, ratio=4)
    assert press.budget(100) == 25 and press.budget(101) == 26
    assert press.keep(held_view(100)).shape[0] == 25


def test_knorm_keeps_the_smallest_key_norms_and_the_recent_window() -> None:
    norms = np.array([5, 1, 4, 0.5, 3, 2, 9, 9], dtype=np.float32)
    keep = KnormPress(max_tokens=5, window=2).keep(held_view(8, norms))
    assert keep.tolist() == [1, 3, 5, 6, 7]


def test_block_norm_keeps_whole_blocks_of_highest_value_to_key_norm() -> None:
    n = 5 * BS + 3  # five full blocks and a partial one
    keys = np.ones(n, dtype=np.float32)
    values = np.ones(n, dtype=np.float32)
    values[2 * BS : 3 * BS] = 7.0  # block 2 scores highest, then block 0
    values[:BS] = 3.0
    keep = BlockNormPress(max_tokens=2 * BS + 3 + 4, window=1).keep(held_view(n, keys, values))
    assert keep.tolist() == [*range(BS), *range(2 * BS, 3 * BS), *range(5 * BS, n)]


# -- compaction in the block manager --------------------------------------------------------------


def admitted(manager: BlockManager, num_tokens: int) -> Request:
    request = Request("r", list(range(1, num_tokens + 1)), SamplingParams(max_tokens=64, ignore_eos=True))
    seq = request.seqs[0]
    seq.num_computed_tokens = manager.allocate(seq)
    manager.append_slots(seq)
    seq.num_computed_tokens = num_tokens  # the prompt's step ran
    manager.mark_computed(seq)
    seq.token_ids.append(7)  # and sampled a token
    return request


def test_compress_frees_the_blocks_the_budget_says_and_copies_into_fresh_ones() -> None:
    manager = CompactingBlockManager(NaiveAllocator(num_blocks=32, block_size=BS))
    seq = admitted(manager, 100).seqs[0]
    old = list(manager.block_table(seq))
    free_before = manager.allocator.num_free_blocks
    keep = SinkWindowPress(sink=4, max_tokens=40).keep(held_view(100))
    copies = manager.compress(seq, keep)
    table = manager.block_table(seq)
    assert len(old) == 7 and len(table) == 3  # ceil(100 / 16) blocks -> ceil(40 / 16)
    assert manager.allocator.num_free_blocks == free_before + 4 == free_before + manager.num_blocks_freed
    assert not set(table) & set(old)  # no kept chunk is one whole old block: every kept token is copied
    src = old[0] * BS + np.arange(4)
    assert copies[:4, 0].tolist() == src.tolist() and copies[:, 1].tolist() == [
        table[j // BS] * BS + j % BS for j in range(40)]
    assert manager.num_evicted(seq) == 60
    assert manager.held_positions(seq).tolist() == [0, 1, 2, 3, *range(64, 100)]
    assert manager.stats().num_token_slots_used == 40
    # the next token (position 100) goes to held slot 40: the third block's ninth slot, in place
    assert manager.append_slots(seq) == [] and manager.stats().num_token_slots_used == 41
    seq.num_computed_tokens += 1
    assert manager.held_positions(seq).tolist()[-2:] == [99, 100]


def test_a_kept_whole_block_is_reused_and_a_prefix_cached_block_is_never_rewritten() -> None:
    manager = CompactingBlockManager(PrefixCachingAllocator(num_blocks=32, block_size=BS))
    seq = admitted(manager, 100).seqs[0]
    old = list(manager.block_table(seq))
    keep = np.concatenate([np.arange(BS), np.arange(70, 100)])  # block 0 whole, then 30 tokens
    copies = manager.compress(seq, keep)
    table = manager.block_table(seq)
    assert table[0] == old[0] and len(table) == 3
    published = set(old[:6])  # the prompt's six full blocks were published to the prefix cache
    assert not published & set(copies[:, 1] // BS)  # copies only ever land in fresh blocks
    # the cache still serves the prompt's prefix with the blocks that hold its true KV
    again = Request("again", list(range(1, 101)), SamplingParams(max_tokens=4)).seqs[0]
    assert manager.allocate(again) == 96 and manager.block_table(again)[:6] == old[:6]


def test_a_compressed_sequence_grows_copies_on_write_and_forgets_compression_when_freed() -> None:
    manager = CompactingBlockManager(NaiveAllocator(num_blocks=32, block_size=BS))
    request = admitted(manager, 40)
    seq = request.seqs[0]
    manager.compress(seq, np.arange(4, 40))  # 36 held: the third block has room
    child = seq.fork(1)
    manager.fork(seq, child)
    assert manager.num_evicted(child) == 4
    copies = manager.append_slots(child)  # writes into the shared third block: a private copy first
    assert len(copies) == 1 and copies[0][0] == manager.block_table(seq)[2]
    manager.free(seq)
    manager.free(child)
    assert manager.allocator.num_free_blocks == 32 and not manager.has_compressed


# -- the copy op ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_copy_slots_moves_each_token_in_every_layer(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(4, 2, 8, BS, 4, generator=gen) for _ in range(2)]
    values = [torch.randn(4, 2, 32, BS, generator=gen) for _ in range(2)]
    before = [c.clone() for c in (*keys, *values)]
    pairs = [(3, 2 * BS), (17, 2 * BS + 1), (2 * BS + 1, 5)]  # a source that another pair overwrites
    kernels.copy_slots(keys, values, pairs, backend=backend)
    def token(cache: torch.Tensor, slot: int) -> torch.Tensor:
        block, offset = divmod(slot, BS)
        return cache[block, :, :, offset] if cache.dim() == 4 else cache[block, :, :, offset, :]

    for src, dst in pairs:
        for cache, old in zip((*keys, *values), before, strict=True):
            assert torch.equal(token(cache, dst), token(old, src))
    with pytest.raises(ValueError, match="slot_mapping slots must be in"):
        kernels.copy_slots(keys, values, [(0, 4 * BS)], backend=backend)


# -- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "kv_press").glob("*.yaml")))
def test_every_kv_press_yaml_composes_and_builds_its_press(name: str) -> None:
    plugins = check_config(compose_config(["model=tiny-random", "logger=none", f"kv_press={name}"]))
    assert (plugins.press is None) == (name == "none")
    if plugins.press is not None:
        assert plugins.press.build().name == name


@pytest.mark.parametrize(("overrides", "message"), [
    (["kv_press=sink-window", "kv_press.ratio=1"], "kv_press.ratio=1.0 must be > 1"),
    (["kv_press=sink-window", "kv_press.ratio=4096"], "kv_press.ratio=4096.0 is >= scheduler.max_model_len"),
    (["kv_press=knorm", "kv_press.ratio=null", "kv_press.max_tokens=8"], "kv_press.window=16 is larger than"),
    (["kv_press=knorm", "kv_press.max_tokens=8"], "needs exactly one budget"),
    (["kv_press=sink-window", "kv_press.sink=-1"], "kv_press.sink=-1"),
    (["kv_press=knorm", "executor=sim"], "which executor=sim does not hold"),
    (["kv_press=sink-window", "scheduler.async_scheduling=true"], "does not run with kv_press=sink-window"),
    (["kv_press=sink-window", "scheduler.preemption_mode=swap"], "scheduler.preemption_mode=recompute"),
    (["kv_press=sink-window", "model.sliding_window=32"], "sliding window"),
    (["kv_press=sink-window", "kv_press.windw=3"], "did you mean kv_press.window"),
])
def test_bad_kv_press_settings_fail_before_any_weights_load(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(compose_config(["model=tiny-random", "logger=none", *overrides]))


# -- end to end on the tiny random model ---------------------------------------------------------


@pytest.fixture(scope="module")
def executor() -> ModelExecutor:
    return make_executor()


class KeptAttention:
    """Dense float64 attention over every K/V computed so far, indexed by position; a query at
    position p attends to the positions up to p that `allowed` still holds."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.allowed = np.zeros(0, dtype=bool)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self.keys[layer] = torch.cat([self.keys.get(layer, k[:0]), k]).double()
        values = self.values[layer] = torch.cat([self.values.get(layer, v[:0]), v]).double()
        n, t = keys.shape[0], q.shape[0]
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("thd,khd->htk", q.double(), keys.repeat_interleave(group, dim=1)) * self.scale
        visible = torch.from_numpy(self.allowed[:n])[None, :] & (
            torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None])
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("htk,khd->thd", weights, values.repeat_interleave(group, dim=1)).to(q.dtype)


@torch.inference_mode()
def kept_greedy(ex: ModelExecutor, prompt: list[int], max_tokens: int, press: SinkWindowPress) -> list[int]:
    """Greedy tokens when each layer attends only to what `press` keeps, judged as the engine does:
    after the prompt, then after every `interval`-th decode."""
    model, attn = ex.model, KeptAttention(ex.scale)
    held = np.arange(len(prompt))

    def judge(num_positions: int) -> np.ndarray:
        keep = press.keep(PressView(held, num_positions, BS))
        if keep is None:
            return held
        attn.allowed[np.setdiff1d(held, held[keep])] = False
        return held[keep]

    attn.allowed = np.ones(len(prompt) + max_tokens, dtype=bool)
    hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn)
    out = [int(model.compute_logits(hidden[-1:]).argmax())]
    held = judge(len(prompt))
    for k in range(1, max_tokens):
        position = len(prompt) + k - 1
        hidden = model.forward(torch.tensor(out[-1:]), torch.tensor([position]), attn)
        out.append(int(model.compute_logits(hidden).argmax()))
        held = np.append(held, position)
        if press.interval and k % press.interval == 0:
            held = judge(position + 1)
    return out


PROMPTS = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (100, 70, 20)]


def press_run(ex: ModelExecutor, *overrides: str, max_tokens: int = 24, model: tuple[str, ...] = ("model=tiny-random",),
              num_blocks: int = 64) -> tuple[list[list[int]], dict]:
    cfg = compose_config([*model, "logger=none", "progress=false", f"allocator.num_blocks={num_blocks}",
                          f"allocator.block_size={BS}", *overrides])
    engine = build_engine(cfg, executor=ex)
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    drive(engine)
    return [r.seqs[0].output_token_ids for r in requests], engine.kv_press_summary()


@pytest.mark.parametrize(("backend", "interval"), [("torch", 0), ("cpu", 0), ("cpu", 5), ("emu", 5)])
def test_sink_window_tokens_equal_attention_over_exactly_the_kept_tokens(executor, backend, interval) -> None:
    settings = dict(sink=4, max_tokens=40, interval=interval)
    outputs, summary = press_run(
        executor, "kv_press=sink-window", "kv_press.ratio=null", *(f"kv_press.{k}={v}" for k, v in settings.items()),
        f"kernel.backend={backend}",
    )
    press = SinkWindowPress(**settings)
    assert outputs == [kept_greedy(executor, p, 24, press) for p in PROMPTS]
    if interval == 0:  # 100 and 70 tokens compressed once to 40: 7 -> 3 and 5 -> 3 blocks; 20 untouched
        assert summary["kv_press_blocks_freed"] == 6 and summary["kv_press_tokens_kept"] == 80
    assert summary["kv_press_compaction_s"] > 0


def test_none_press_runs_the_plain_engine(executor) -> None:
    cfg = compose_config(["model=tiny-random", "logger=none", "progress=false", "allocator.num_blocks=64"])
    assert OmegaConf.select(cfg, "kv_press._target_") is None
    engine = build_engine(cfg, executor=executor)
    assert type(engine.scheduler.block_manager) is not CompactingBlockManager
    assert engine.scheduler.press_step is None and engine.kv_press_summary() == {}
    engine.add_request(Request("r", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0)))
    sched = engine.scheduler.schedule(0.0)
    assert sched.slots_to_compact is None and sched.kv_offsets is None and not sched.press_rows
    outputs, _ = press_run(executor)
    assert outputs == [kept_greedy(executor, p, 24, SinkWindowPress(max_tokens=4096)) for p in PROMPTS]


@pytest.mark.parametrize("press", ["knorm", "block-norm"])
def test_norm_presses_free_blocks_and_keep_the_prompts_first_token(executor, press) -> None:
    outputs, summary = press_run(executor, f"kv_press={press}", "kv_press.ratio=null", "kv_press.max_tokens=32",
                                 "kv_press.window=8")
    plain, _ = press_run(executor)
    assert [o[0] for o in outputs] == [o[0] for o in plain]  # sampled from the prefill, before any compression
    assert outputs[2] == plain[2]  # 20 tokens: within the budget
    assert summary["kv_press_num_compressions"] == 2
    # knorm keeps 32 tokens: 7 -> 2 and 5 -> 2 blocks; block-norm the protected 20 (whole blocks and the last)
    assert summary["kv_press_blocks_freed"] == (8 if press == "knorm" else 5 + 3)
