"""KV groups per layer type in the real executor, driven by hand-built SchedulerOutputs: `model=tiny-hybrid`
(full attention on layers 0-1, a 32-token window on 2-5) with a table per group whose sliding groups
lose the blocks that leave their window (the entries then name a block of NaNs) generates what one
group generates; a block holds `num_slots` layers; block copies reach every KV tensor; and what the
executor cannot run with groups, or a backend cannot serve, is one ConfigError before the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from paged.config import ConfigError, KernelConfig, ModelConfig
from paged.executor.layer_types import check_kv_layout
from paged.executor.model_executor import ModelExecutor
from paged.kv_layout import KVLayout
from paged.model import weights
from paged.request import Request, SamplingParams
from paged.step import ScheduledSeq
from tests.test_executor import BLOCK, contiguous_tables, generate, step

WINDOWS = (None, None, 32, 32, 32, 32)
PROMPTS = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 75)]
MAX_NEW = 10
POISON = 0  # the block freed entries name: NaN in every KV tensor


def tiny_hybrid(backend: str = "torch") -> ModelExecutor:
    arch = {"num_layers": 6, "qkv_bias": True, "layer_windows": list(WINDOWS)}
    return ModelExecutor(ModelConfig(name="tiny-hybrid", source="random", arch=arch, device="cpu"),
                         KernelConfig(name="t", backend=backend, partition_size=32))


def test_a_block_holds_num_slots_layers_and_the_cache_num_slots_tensors() -> None:
    ex = tiny_hybrid()
    assert ex.layer_windows == WINDOWS and ex.sliding_window is None
    single = ex.kv_cache_spec(BLOCK).bytes_per_block
    assert single == 2 * 6 * BLOCK * 1 * 64 * 4
    layout = KVLayout.build(ex.layer_windows, "auto")
    ex.set_kv_layout(layout)
    spec = ex.kv_cache_spec(BLOCK)
    assert (layout.num_groups, layout.num_slots) == (3, 2)
    assert spec.bytes_per_block * 3 == single
    assert "3 KV groups, 2 layers a block" in spec.layout
    ex.init_kv_cache(num_blocks=8, block_size=BLOCK, num_cpu_blocks=2)
    assert len(ex.key_caches) == len(ex.value_caches) == len(ex.cpu_key_caches) == 2
    assert ex.key_caches[0].shape[0] == 8 and ex.cpu_value_caches[1].shape[0] == 2


def generate_in_groups(ex: ModelExecutor, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Prefill, then decode, with one table per KV group from disjoint pool blocks; after each step a
    sliding group's entries for blocks wholly before its window name the NaN block, as a block
    manager that freed them may (another sequence may hold them by then)."""
    layout = ex.kv_layout
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [Request(str(i), p, params).seqs[0] for i, p in enumerate(prompts)]
    lengths = [len(p) + max_tokens for p in prompts]
    per_group = sum(-(-n // BLOCK) for n in lengths)
    tables = [contiguous_tables(lengths, first_block=1 + g * per_group) for g in range(layout.num_groups)]

    def scheduled(new_tokens: list[int]) -> list[ScheduledSeq]:
        return [ScheduledSeq(s, n, tables[0][i], group_tables=[t[i] for t in tables])
                for i, (s, n) in enumerate(zip(seqs, new_tokens, strict=True))]

    def free_what_left_the_windows() -> None:
        for g, group in enumerate(layout.groups):
            for i, s in enumerate(seqs):
                # the next query, at position num_computed, sees keys past num_computed - window
                first_seen = s.num_computed_tokens - group.window + 1 if group.window else 0
                for b in range(max(first_seen, 0) // BLOCK):
                    tables[g][i][b] = POISON

    step(ex, scheduled([s.num_tokens for s in seqs]), prefill=True)
    for _ in range(max_tokens - 1):
        free_what_left_the_windows()
        step(ex, scheduled([1] * len(seqs)), prefill=False)
    assert any(POISON in t for group in tables[1:] for t in group), "the windows must have freed blocks"
    return [s.output_token_ids for s in seqs]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_groups_with_freed_blocks_generate_what_one_group_does(backend: str) -> None:
    ex = tiny_hybrid(backend)
    ex.init_kv_cache(num_blocks=64, block_size=BLOCK)
    expected = generate(ex, PROMPTS, MAX_NEW)
    ex.set_kv_layout(KVLayout.build(ex.layer_windows, "auto"))
    ex.init_kv_cache(num_blocks=64, block_size=BLOCK)
    for cache in (*ex.key_caches, *ex.value_caches):
        cache[POISON] = float("nan")
    assert generate_in_groups(ex, PROMPTS, MAX_NEW) == expected


def test_block_copies_reach_every_kv_tensor() -> None:
    ex = tiny_hybrid()
    ex.set_kv_layout(KVLayout.build(ex.layer_windows, "auto"))
    ex.init_kv_cache(num_blocks=8, block_size=BLOCK)
    for slot, cache in enumerate((*ex.key_caches, *ex.value_caches)):
        cache[3] = slot + 1.0
    seq = Request("0", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)).seqs[0]
    step(ex, [ScheduledSeq(seq, 3, [1], group_tables=[[1], [2], [4]])], prefill=True, copies=[(3, 6)])
    for slot, cache in enumerate((*ex.key_caches, *ex.value_caches)):
        assert bool((cache[6] == slot + 1.0).all())


def test_kv_groups_refuse_tensor_parallelism_and_cuda_graphs() -> None:
    layout = KVLayout.build(WINDOWS, "auto")
    with pytest.raises(ConfigError, match=r"3 KV groups, which executor.tensor_parallel_size=2 does not run; use "
                                          r"allocator.kv_groups=single"):
        check_kv_layout(layout, WINDOWS, num_devices=2, cuda_graphs=None)
    with pytest.raises(ConfigError, match="executor.cuda_graphs=true does not capture; use allocator.kv_groups=single"):
        check_kv_layout(layout, WINDOWS, num_devices=1, cuda_graphs=True)
    check_kv_layout(layout, WINDOWS, num_devices=1, cuda_graphs=None)
    # one group runs with both
    check_kv_layout(KVLayout.build(WINDOWS, "single"), WINDOWS, num_devices=2, cuda_graphs=True)
    with pytest.raises(ConfigError, match="a KV layout of 2 layers for a model of 6"):
        check_kv_layout(KVLayout.build([None, 32], "auto"), WINDOWS, num_devices=1, cuda_graphs=None)


@pytest.fixture(scope="module")
def gemma2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("gemma2")
    Gemma2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("backend", ["cpu", "cuda", "emu"])
def test_a_backend_without_soft_capping_is_refused_before_weights_load(
    gemma2_checkpoint: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_weights(*args: object) -> None:
        raise AssertionError("weights were read before the backend was checked")

    monkeypatch.setattr(weights, "read_weights", no_weights)
    expected = (f"kernel.backend={backend} cannot serve gemma2: its layers need attention softcap "
                r"\(attn_logit_softcapping=50.0\), which backend .* does not implement; allowed: "
                "kernel.backend=torch or kernel.backend=auto")
    with pytest.raises(ConfigError, match=expected):
        ModelExecutor(ModelConfig(name="gemma2", source="hf", path=str(gemma2_checkpoint), device="cpu"),
                      KernelConfig(name="t", backend=backend))
