"""Presses that read attention: the attention mass op against a float64 reference (paged cache, GQA,
prefix hits, the last w queries), snapkv's and h2o's choices, and end to end on the tiny random model:
the mass the executor hands the press equals a dense float64 forward's, and blocks freed = budget."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

from paged.config import ConfigError, compose_config
from paged.engine.builder import check_config
from paged.kernels.backends import cpu, torch_ref
from paged.kernels.backends.interface import CacheView
from paged.memory.press import H2OPress, PressView, SnapKVPress
from paged.memory.press.snapkv import pooled
from tests.test_kv_press import BS, PROMPTS, executor, press_run  # noqa: F401 (the executor fixture)

# -- the mass op ------------------------------------------------------------------------------------


def paged_cache(keys: list[torch.Tensor], block_size: int, x: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A key cache `[blocks, Hk, D/x, bs, x]` holding each sequence's `[L, Hk, D]` keys in shuffled
    blocks, and the block tables."""
    num_kv_heads, head_size = keys[0].shape[1:]
    counts = [-(-k.shape[0] // block_size) for k in keys]
    order = torch.randperm(sum(counts) + 3, generator=torch.Generator().manual_seed(0))
    cache = torch.randn(order.shape[0], num_kv_heads, head_size // x, block_size, x)  # stale slots: noise
    tables = torch.zeros(len(keys), max(counts), dtype=torch.int32)
    used = 0
    for i, k in enumerate(keys):
        for b in range(counts[i]):
            block = int(order[used])
            used += 1
            tables[i, b] = block
            chunk = k[b * block_size : (b + 1) * block_size]
            cache[block, :, :, : chunk.shape[0]] = chunk.permute(1, 2, 0).reshape(num_kv_heads, head_size // x, x,
                                                                                   -1).transpose(2, 3)
    return cache, tables


def reference_mass(q: torch.Tensor, k: torch.Tensor, scale: float, last: int | None) -> torch.Tensor:
    """float64 `[Hk, L]`: the mass of q's last `last` queries (the last of the L positions) on k."""
    length, num_kv_heads = k.shape[0], k.shape[1]
    group = q.shape[1] // num_kv_heads
    total = torch.zeros(num_kv_heads, length, dtype=torch.float64)
    first = length - q.shape[0]
    for t in range(q.shape[0] if last is None else min(last, q.shape[0])):
        j = q.shape[0] - 1 - t
        for h in range(q.shape[1]):
            logits = (k[: first + j + 1, h // group].double() @ q[j, h].double()) * scale
            total[h // group, : first + j + 1] += torch.softmax(logits, dim=0)
    return total


@pytest.mark.parametrize("backend", [torch_ref.BACKEND, cpu.BACKEND], ids=["torch", "cpu"])
@pytest.mark.parametrize("last", [None, 3])
def test_attention_mass_equals_the_float64_reference(backend, last: int | None) -> None:
    torch.manual_seed(1)
    heads, kv_heads, d, x, bs = 4, 2, 16, 4, 8
    lengths, num_queries = [21, 8, 33], [21, 1, 5]  # a prompt, a decode row, a chunk after a prefix hit
    keys = [torch.randn(n, kv_heads, d) for n in lengths]
    key_cache, tables = paged_cache(keys, bs, x)
    queries = [torch.randn(n, heads, d) for n in num_queries]
    value_cache = torch.zeros(key_cache.shape[0], kv_heads, d, bs)
    cache = CacheView(key_cache, value_cache, tables, torch.tensor(lengths, dtype=torch.int32))
    starts = np.concatenate([[0], np.cumsum(num_queries)])
    mass = backend.attention_mass(torch.cat(queries), cache, starts, 0.3, last)
    assert mass.shape == (3, kv_heads, max(lengths)) and mass.dtype == torch.float32
    for i, n in enumerate(lengths):
        expected = reference_mass(queries[i], keys[i], 0.3, last)
        torch.testing.assert_close(mass[i, :, :n].double(), expected, rtol=1e-5, atol=1e-6)
        assert not mass[i, :, n:].any()
        counted = num_queries[i] if last is None else min(last, num_queries[i])
        torch.testing.assert_close(mass[i].sum(dim=-1).double(), torch.full((kv_heads,), 2.0 * counted,
                                                                             dtype=torch.float64))


# -- the presses ------------------------------------------------------------------------------------


def test_pooling_averages_a_centred_window_clipped_at_the_ends() -> None:
    scores = np.array([0, 0, 6, 0, 0, 3], dtype=np.float32)
    assert pooled(scores, 3).tolist() == [0, 2, 2, 2, 1, 1.5]
    assert pooled(scores, 1) is scores


def test_snapkv_keeps_the_pooled_heaviest_and_the_recent_window() -> None:
    scores = np.zeros(40, dtype=np.float32)
    scores[[5, 20]] = [1.0, 2.0]
    press = SnapKVPress(queries=4, kernel=3, max_tokens=10, window=4)
    keep = press.keep(PressView(np.arange(40), 40, BS, scores=scores))
    # 6 of the 36 older tokens: the peaks and a neighbour each side (pooled 2/3), then the earliest of the 1/3s
    assert keep.tolist() == [4, 5, 6, 19, 20, 21, 36, 37, 38, 39]
    assert press.score_queries == 4


def test_h2o_keeps_the_largest_accumulated_mass_and_the_recent_window() -> None:
    scores = np.array([9, 1, 8, 2, 7, 3, 0, 0], dtype=np.float32)
    keep = H2OPress(max_tokens=5, window=2).keep(PressView(np.arange(8), 8, BS, scores=scores))
    assert keep.tolist() == [0, 2, 4, 6, 7]
    assert H2OPress.accumulates and H2OPress(ratio=2).score_queries is None


def test_h2o_gives_half_its_budget_to_the_recent_tokens_as_the_paper_does() -> None:
    # the heaviest tokens are the earliest (every later query saw them): a window alone would keep only those
    scores = np.arange(20, 0, -1, dtype=np.float32)
    view = PressView(np.arange(20), 20, BS, scores=scores)
    assert H2OPress(max_tokens=8, window=2).keep(view).tolist() == [0, 1, 2, 3, 16, 17, 18, 19]
    assert H2OPress(max_tokens=8, window=2, recent_share=0).keep(view).tolist() == [0, 1, 2, 3, 4, 5, 18, 19]
    assert H2OPress(max_tokens=8, window=6, recent_share=0.5).keep(view).tolist() == [0, 1, *range(14, 20)]


# -- end to end -------------------------------------------------------------------------------------


class RecordingSnapKV(SnapKVPress):
    """snapkv, keeping every view it judged."""

    views: ClassVar[list[PressView]] = []

    def keep(self, view: PressView) -> np.ndarray | None:
        RecordingSnapKV.views.append(view)
        return super().keep(view)


class RecordingH2O(H2OPress):
    """h2o, keeping every view it judged."""

    views: ClassVar[list[PressView]] = []

    def keep(self, view: PressView) -> np.ndarray | None:
        RecordingH2O.views.append(view)
        return super().keep(view)


class MassAttention:
    """Dense float64 attention over each layer's K/V so far, recording the mass of the last `last`
    queries of each call (summed over KV heads) per layer."""

    def __init__(self, scale: float, last: int | None) -> None:
        self.scale, self.last = scale, last
        self.mass: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        self.mass.append(reference_mass(q, k, self.scale, self.last).sum(dim=0))
        scores = torch.einsum("thd,khd->htk", q.double(), k.repeat_interleave(group, dim=1).double()) * self.scale
        causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return torch.einsum("htk,khd->thd", weights, v.repeat_interleave(group, dim=1).double()).to(q.dtype)


@pytest.mark.parametrize("backend", ["torch", "cpu", "emu"])  # emu: the CUDA mass and slot-copy kernels
def test_snapkv_reads_the_float64_mass_of_the_prompts_last_queries(executor, backend) -> None:  # noqa: F811
    RecordingSnapKV.views.clear()
    outputs, summary = press_run(
        executor, "kv_press=snapkv", f"kv_press._target_={__name__}.RecordingSnapKV", "kv_press.ratio=null",
        "kv_press.max_tokens=32", "kv_press.window=8", "kv_press.queries=6", f"kernel.backend={backend}",
    )
    assert len(RecordingSnapKV.views) == 2  # the 100- and 70-token prompts; 20 tokens is within the budget
    for view, prompt in zip(RecordingSnapKV.views, PROMPTS, strict=False):
        attn = MassAttention(executor.scale, 6)
        with torch.inference_mode():
            executor.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn)
        expected = torch.stack(attn.mass).mean(dim=0).numpy()
        np.testing.assert_allclose(view.scores, expected, rtol=1e-4, atol=1e-5)
    assert summary["kv_press_blocks_freed"] == 8 and summary["kv_press_tokens_kept"] == 64  # 7 -> 2, 5 -> 2
    plain, _ = press_run(executor, f"kernel.backend={backend}")
    assert [o[0] for o in outputs] == [o[0] for o in plain] and outputs[2] == plain[2]


def test_h2o_sums_the_mass_of_every_prompt_query_then_every_decode(executor) -> None:  # noqa: F811
    RecordingH2O.views.clear()
    press_run(executor, "kv_press=h2o", f"kv_press._target_={__name__}.RecordingH2O", "kv_press.ratio=null",
              "kv_press.max_tokens=32", "kv_press.window=8", "kv_press.interval=4", max_tokens=9)
    first = RecordingH2O.views[:2]  # after the 100- and 70-token prompts
    for view, prompt in zip(first, PROMPTS, strict=False):
        attn = MassAttention(executor.scale, None)
        with torch.inference_mode():
            executor.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn)
        np.testing.assert_allclose(view.scores, torch.stack(attn.mass).mean(dim=0).numpy(), rtol=1e-4, atol=1e-4)
    heads = first[0].scores.sum() / 100  # each query's weights sum to 1 per head
    for view in first:
        kept = H2OPress(max_tokens=32, window=8).keep(view)
        # judged again 4 decodes later: the 32 kept sums carried on, plus 4 queries' mass over 36 tokens
        later = next(v for v in RecordingH2O.views[2:]
                     if v.num_held == 36 and np.array_equal(v.positions[:32], view.positions[kept]))
        assert (later.scores[:32] >= view.scores[kept] - 1e-6).all()
        assert later.scores.sum() == pytest.approx(view.scores[kept].sum() + 4 * heads, rel=1e-4)


@pytest.mark.parametrize("interval", [0, 4])
def test_h2o_frees_the_blocks_its_budget_says(executor, interval) -> None:  # noqa: F811
    outputs, summary = press_run(executor, "kv_press=h2o", "kv_press.ratio=null", "kv_press.max_tokens=32",
                                 "kv_press.window=8", f"kv_press.interval={interval}")
    if interval == 0:
        plain, _ = press_run(executor)
        assert outputs[2] == plain[2]  # 20 + 24 tokens: judged only after its prompt, within the budget
        assert summary["kv_press_num_compressions"] == 2 and summary["kv_press_blocks_freed"] == 8
    else:  # judged again every 4 decodes (the 20-token prompt too, once it outgrows 32), each time back to 32
        assert summary["kv_press_num_compressions"] > 3
        assert summary["kv_press_tokens_kept"] == 32 * summary["kv_press_num_compressions"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["kv_press=snapkv", "executor.tensor_parallel_size=2"], "executor.tensor_parallel_size=1"),
    (["kv_press=snapkv", "kv_press.queries=0"], "kv_press.queries=0"),
    (["kv_press=snapkv", "kv_press.kernel=0"], "kv_press.kernel=0"),
    (["kv_press=h2o", "kv_press.ratio=1"], "kv_press.ratio=1"),
    (["kv_press=h2o", "kv_press.recent_share=1.5"], "kv_press.recent_share=1.5"),
])
def test_bad_scoring_press_settings_fail_before_any_weights_load(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(compose_config(["model=tiny-random", "logger=none", *overrides]))
