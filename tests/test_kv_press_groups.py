"""KV compression per KV group (`paged.memory.group_compaction`): on a model whose full-attention
layers form two KV groups beside a windowed one, a press judges each full group from that group's
own norms or attention mass and compresses its own table, freeing its own blocks, while the windowed
group is left to its window; end to end, the greedy tokens equal a dense float64 reference in which
each full-attention layer attends to exactly the positions its group kept (at their original
positions) and each windowed layer to its window."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

from paged.config import ConfigError, KernelConfig, ModelConfig, compose_config
from paged.engine.builder import build_engine, check_config
from paged.executor.model_executor import ModelExecutor
from paged.kv_layout import KVLayout
from paged.memory import NaiveAllocator
from paged.memory.group_compaction import CompactingGroupManager
from paged.memory.kv_groups import KVGroupManager
from paged.memory.press import KnormPress, PressView, SinkWindowPress, SnapKVPress
from paged.request import Request, SamplingParams
from tests.test_kv_press import BS, PROMPTS, admitted, press_run
from tests.test_kv_press_scores import MassAttention

# layers 0-3 attend to everything, 4-5 within 32 tokens: groups (0, 1) and (2, 3) full, (4, 5) windowed
WINDOWS = (None, None, None, None, 32, 32)
LAYOUT = KVLayout.build(WINDOWS)
FULL = LAYOUT.full_groups
HYBRID = ["model=tiny-hybrid", "model.arch.layer_windows=[null,null,null,null,32,32]"]
QUIET = ["logger=none", "progress=false"]


def test_the_layout_has_two_full_groups_and_a_windowed_one() -> None:
    assert [g.layers for g in LAYOUT.groups] == [(0, 1), (2, 3), (4, 5)] and FULL == (0, 1)


# -- the manager ---------------------------------------------------------------------------------


def group_manager(num_blocks: int = 64) -> CompactingGroupManager:
    return CompactingGroupManager(NaiveAllocator(num_blocks=num_blocks, block_size=BS), LAYOUT, watermark=0.0)


def test_each_full_group_compresses_to_its_own_keep_set_and_frees_what_the_budget_says() -> None:
    bm = group_manager()
    seq = admitted(bm, 100).seqs[0]
    before = bm.group_tables(seq)
    free_before = bm.allocator.num_free_blocks
    sink = SinkWindowPress(sink=4, max_tokens=40).keep(PressView(np.arange(100), 100, BS))
    other = np.concatenate([np.arange(20, 50), np.arange(90, 100)])  # 40 tokens too
    copies = bm.compress_each(seq, [sink, other])
    tables = bm.group_tables(seq)
    # each full group: ceil(100 / 16) = 7 blocks -> ceil(40 / 16) = 3; the windowed group untouched
    assert [len(t) for t in tables[:2]] == [3, 3] and tables[2] == before[2]
    assert bm.allocator.num_free_blocks == free_before + 2 * 4
    assert [p.num_blocks_freed for p in bm.compacting] == [4, 4]
    assert bm.num_evicted(seq) == 60 and bm.groups[2].block_table(seq) == before[2]
    assert bm.compacting[0].held_positions(seq).tolist() == [0, 1, 2, 3, *range(64, 100)]
    assert bm.compacting[1].held_positions(seq).tolist() == other.tolist()
    # every group's copies land in its own fresh blocks
    fresh = {b for t in tables[:2] for b in t}
    assert set((copies[:, 1] // BS).tolist()) <= fresh and copies.shape[0] == 80
    # the next token: held slot 40 in each full group, position 100 in the windowed one, which holds
    # the blocks its window touches (positions 64 on)
    assert bm.append_slots(seq) == [] and bm.stats().num_token_slots_used == 41 + 41 + (101 - 64)
    assert bm.stats().num_allocated_blocks == 3 + 3 + 3
    bm.free(seq)
    assert bm.allocator.num_free_blocks == 64 and not bm.has_compressed


def test_the_groups_compress_together_or_not_at_all() -> None:
    bm = group_manager(num_blocks=3 * 7 + 5)  # room for one group's copies (3 fresh blocks), not both
    seq = admitted(bm, 100).seqs[0]
    tables, free = bm.group_tables(seq), bm.allocator.num_free_blocks
    keep = np.arange(60, 100)
    assert free < 6 and bm.compress_each(seq, [keep, keep]) is None
    assert bm.group_tables(seq) == tables and bm.allocator.num_free_blocks == free and not bm.has_compressed
    with pytest.raises(ValueError, match=r"kept \[40, 39\] tokens .* as many in each group"):
        bm.compress_each(seq, [keep, keep[1:]])


# -- end to end on a tiny hybrid model -----------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid() -> ModelExecutor:
    arch = {"num_layers": 6, "qkv_bias": True, "layer_windows": list(WINDOWS)}
    return ModelExecutor(ModelConfig(name="tiny-hybrid", source="random", arch=arch, device="cpu"),
                         KernelConfig(name="t", backend="torch", partition_size=32))


class RecordingKnorm(KnormPress):
    """knorm, keeping every view it judged (one per compressed group, in group order)."""

    views: ClassVar[list[PressView]] = []

    def keep(self, view: PressView) -> np.ndarray | None:
        RecordingKnorm.views.append(view)
        return super().keep(view)


class RecordingSnapKV(SnapKVPress):
    views: ClassVar[list[PressView]] = []

    def keep(self, view: PressView) -> np.ndarray | None:
        RecordingSnapKV.views.append(view)
        return super().keep(view)


def hybrid_run(ex: ModelExecutor, *overrides: str, max_tokens: int = 24) -> tuple[list[list[int]], dict]:
    return press_run(ex, *overrides, max_tokens=max_tokens, model=(*HYBRID, "model.device=cpu"), num_blocks=96)


class GroupedKeptAttention:
    """Dense float64 attention over every K/V computed so far, by position: a full-attention layer
    attends to the positions its group still holds (`allowed[group]`), a windowed one to its window."""

    def __init__(self, scale: float, num_positions: int) -> None:
        self.scale = scale
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.allowed = {g: np.ones(num_positions, dtype=bool) for g in FULL}

    def key_norms(self, group: int, positions: np.ndarray) -> np.ndarray:
        """The executor's norms: per position, ||k|| averaged over the group's layers and KV heads."""
        layers = LAYOUT.groups[group].layers
        return np.mean([self.keys[layer][positions].norm(dim=-1).mean(dim=-1).numpy() for layer in layers], axis=0)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self.keys[layer] = torch.cat([self.keys.get(layer, k[:0].double()), k.double()])
        values = self.values[layer] = torch.cat([self.values.get(layer, v[:0].double()), v.double()])
        n, t = keys.shape[0], q.shape[0]
        key_pos, query_pos = torch.arange(n)[None, :], torch.arange(n - t, n)[:, None]
        visible = key_pos <= query_pos
        window = WINDOWS[layer]
        if window is None:
            visible &= torch.from_numpy(self.allowed[LAYOUT.group_of_layer[layer]][:n])[None, :]
        else:
            visible &= key_pos > query_pos - window
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("thd,khd->htk", q.double(), keys.repeat_interleave(group, dim=1)) * self.scale
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("htk,khd->thd", weights, values.repeat_interleave(group, dim=1)).to(q.dtype)


@torch.inference_mode()
def grouped_greedy(ex: ModelExecutor, prompt: list[int], max_tokens: int, press: KnormPress) -> list[list[int]]:
    """Greedy tokens when each full group's layers attend only to what knorm keeps of that group, from
    that group's own key norms, judged as the engine does; also each judgement's kept positions."""
    model, attn = ex.model, GroupedKeptAttention(ex.scale, len(prompt) + max_tokens)
    held = {g: np.arange(len(prompt)) for g in FULL}
    kept_sets: list[list[int]] = []

    def judge(num_positions: int) -> None:
        for g in FULL:
            keep = press.keep(PressView(held[g], num_positions, BS, attn.key_norms(g, held[g])))
            if keep is not None:
                attn.allowed[g][np.setdiff1d(held[g], held[g][keep])] = False
                held[g] = held[g][keep]
                kept_sets.append(held[g].tolist())

    hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn)
    out = [int(model.compute_logits(hidden[-1:]).argmax())]
    judge(len(prompt))
    for step in range(1, max_tokens):
        position = len(prompt) + step - 1
        hidden = model.forward(torch.tensor(out[-1:]), torch.tensor([position]), attn)
        out.append(int(model.compute_logits(hidden).argmax()))
        held = {g: np.append(h, position) for g, h in held.items()}
        if press.interval and step % press.interval == 0:
            judge(position + 1)
    return [out, *kept_sets]


@pytest.mark.parametrize(("backend", "interval"), [("torch", 0), ("cpu", 5)])
def test_each_full_group_attends_to_its_own_kept_tokens_and_the_window_to_its_window(hybrid, backend, interval):
    settings = dict(max_tokens=32, window=8, interval=interval)
    RecordingKnorm.views.clear()
    outputs, summary = hybrid_run(
        hybrid, "kv_press=knorm", f"kv_press._target_={__name__}.RecordingKnorm", "kv_press.ratio=null",
        *(f"kv_press.{k}={v}" for k, v in settings.items()), f"kernel.backend={backend}",
    )
    press = KnormPress(**settings)
    reference = [grouped_greedy(hybrid, p, 24, press) for p in PROMPTS]
    assert outputs == [r[0] for r in reference]
    # the prompts' judgements: each group's view has that group's norms, and the groups kept different tokens
    prompt_views = RecordingKnorm.views[:4]  # two groups of the 100- and 70-token prompts
    for i, prompt_run in enumerate(reference[:2]):
        first, second = prompt_views[2 * i : 2 * i + 2]
        assert prompt_run[1] != prompt_run[2]
        for view, kept in zip((first, second), prompt_run[1:3], strict=True):
            assert view.positions[press.keep(view)].tolist() == kept
    if interval == 0:  # per full group 7 -> 2 and 5 -> 2 blocks; 20 tokens untouched
        assert summary["kv_press_blocks_freed"] == 2 * (5 + 3) and summary["kv_press_tokens_kept"] == 2 * 2 * 32
        assert summary["kv_press_num_compressions"] == 2
    assert summary["kv_press_compaction_s"] > 0


def test_snapkv_reads_each_groups_own_float64_mass(hybrid) -> None:
    RecordingSnapKV.views.clear()
    _, summary = hybrid_run(hybrid, "kv_press=snapkv", f"kv_press._target_={__name__}.RecordingSnapKV",
                            "kv_press.ratio=null", "kv_press.max_tokens=32", "kv_press.window=8",
                            "kv_press.queries=6", max_tokens=2)
    assert len(RecordingSnapKV.views) == 4  # 2 prompts over the budget x 2 full groups
    for i, prompt in enumerate(PROMPTS[:2]):
        attn = MassAttention(hybrid.scale, 6)  # full attention everywhere: layers 0-3 come before the windowed ones
        with torch.inference_mode():
            hybrid.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn)
        for g, view in zip(FULL, RecordingSnapKV.views[2 * i : 2 * i + 2], strict=True):
            expected = torch.stack([attn.mass[layer] for layer in LAYOUT.groups[g].layers]).mean(dim=0).numpy()
            np.testing.assert_allclose(view.scores, expected, rtol=1e-4, atol=1e-5)
    assert summary["kv_press_blocks_freed"] == 2 * (5 + 3)


@pytest.mark.parametrize(("press", "compressions", "freed", "kept"), [
    # after the prompts 7 -> 2 and 5 -> 2 blocks, 32 tokens each; 4 decodes later 3 -> 2 blocks again
    ("sink-window", 2 + 2, 2 * (5 + 3 + 1 + 1), 2 * 4 * 32),
    ("h2o", 2 + 2, 2 * (5 + 3 + 1 + 1), 2 * 4 * 32),
    # the protected whole blocks only (80-99 and 48-69), within the budget 4 decodes later
    ("block-norm", 2, 2 * (5 + 3), 2 * (20 + 22)),
])
def test_every_press_frees_per_full_group_what_its_budget_says(hybrid, press, compressions, freed, kept) -> None:
    _, summary = hybrid_run(hybrid, f"kv_press={press}", "kv_press.ratio=null", "kv_press.max_tokens=32",
                            "kv_press.window=8", "kv_press.interval=4", max_tokens=9)
    assert summary["kv_press_num_compressions"] == compressions
    assert summary["kv_press_blocks_freed"] == freed and summary["kv_press_tokens_kept"] == kept


def test_no_press_on_a_hybrid_model_is_the_plain_group_manager(hybrid) -> None:
    engine = build_engine(compose_config([*HYBRID, *QUIET, "model.device=cpu", "allocator.num_blocks=96"]),
                          executor=hybrid)
    assert type(engine.scheduler.block_manager) is KVGroupManager and engine.scheduler.press_step is None
    engine.add_request(Request("r", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0)))
    sched = engine.scheduler.schedule(0.0)
    assert sched.kv_offsets is None and sched.slots_to_compact is None and not sched.press_rows


@pytest.mark.parametrize(("overrides", "message"), [
    ([*HYBRID, "kv_press=sink-window", "allocator.kv_groups=single"], "needs allocator.kv_groups=auto on model=tiny-"),
    (["model=tiny-random", "model.sliding_window=32", "kv_press=knorm"], "has nothing to compress on model=tiny-"),
    ([*HYBRID, "kv_press=knorm", "executor=sim"], "which executor=sim does not hold"),
])
def test_what_groups_still_cannot_compress_is_one_line_before_any_weights_load(monkeypatch, overrides, message):
    def refuse(*_, **__):
        raise AssertionError("weights were loaded before the config error")

    monkeypatch.setattr("paged.executor.model_executor.load_weights", refuse)
    with pytest.raises(ConfigError, match=message) as e:
        check_config(compose_config([*QUIET, *overrides]))
    assert "\n" not in str(e.value)
