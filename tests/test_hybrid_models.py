"""Models whose layers attend differently, end to end against transformers: `model=tiny-hybrid` (a
random Qwen2-style model, full attention on layers 0-1 and a 32-token window on 2-5) against the
Qwen2 with the same weights and `max_window_layers=2`; tiny random Gemma-2 and Gemma-3 checkpoints
and a Qwen2 with `max_window_layers` through `model=hf`. Greedy tokens must equal transformers'
`generate`, with KV groups per layer type and with one group, on prompts well past the windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from paged import LLM, SamplingParams
from paged.model.locate import locate_smollm2
from paged.model.tiny import random_state, tiny_arch
from paged.model.tokenizer import load_hf_tokenizer

MAX_NEW = 12
# lengths across the 32-token window and the 16-token blocks
PROMPTS = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (45, 90)]
HYBRID_WINDOWS = [None, None, 32, 32, 32, 32]
# initializer_range 0.3 makes the logits peaked: greedy never hinges on a float near-tie
SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, max_position_embeddings=512, initializer_range=0.3, attn_implementation="eager")


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    outputs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, eos_token_id=None,
                              pad_token_id=0) for p in prompts]
    return [out[0, len(p) :].tolist() for p, out in zip(prompts, outputs, strict=True)]


def serve(model: str, *overrides: str) -> LLM:
    # float32 as transformers runs them: `auto` is bfloat16 on a CPU with bf16 arithmetic
    return LLM(model, allocator="naive", overrides=["model.device=cpu", "model.dtype=float32",
                                                    "allocator.block_size=16", "allocator.num_blocks=96", *overrides])


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0))
    return [o.token_ids for o in outs]


def tiny_hybrid_reference() -> Qwen2ForCausalLM:
    """transformers' Qwen2 with `model=tiny-hybrid`'s shape and seeded weights."""
    arch = tiny_arch({"num_layers": 6, "qkv_bias": True, "layer_windows": HYBRID_WINDOWS})
    config = Qwen2Config(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        rope_theta=arch.rope_theta, rms_norm_eps=arch.rms_norm_eps, tie_word_embeddings=False,
        max_position_embeddings=arch.max_position_embeddings, use_sliding_window=True, sliding_window=32,
        max_window_layers=2, attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(config).eval()
    model.load_state_dict(random_state(arch, seed=0))
    return model


@pytest.fixture(scope="module")
def tiny_hybrid_expected() -> list[list[int]]:
    return hf_greedy(tiny_hybrid_reference(), PROMPTS)


def test_the_windows_change_what_tiny_hybrid_generates(tiny_hybrid_expected) -> None:
    full = tiny_hybrid_reference()
    full.config.layer_types = ["full_attention"] * 6
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    assert hf_greedy(full, PROMPTS[1:]) != tiny_hybrid_expected[1:], "the test model must depend on its windows"


@pytest.mark.parametrize(("backend", "groups"), [("torch", "auto"), ("cpu", "auto"), ("cpu", "single")])
def test_tiny_hybrid_greedy_equals_transformers(tiny_hybrid_expected, groups: str, backend: str) -> None:
    llm = serve("tiny-hybrid", f"allocator.kv_groups={groups}", f"kernel.backend={backend}")
    assert llm.executor.layer_windows == tuple(HYBRID_WINDOWS)
    assert llm.executor.kv_layout.num_groups == (3 if groups == "auto" else 1)
    assert greedy(llm) == tiny_hybrid_expected


def save(model: PreTrainedModel, path: Path) -> Path:
    model.save_pretrained(path)
    # prompts are token ids: the tokenizer only has to exist (it decodes outputs to text)
    load_hf_tokenizer(str(locate_smollm2())).save_pretrained(path)
    return path


def perturbed_norms(model: PreTrainedModel) -> PreTrainedModel:
    """Gemma initialises its norm weights to 0 ((1 + w) = 1): random ones catch a norm read wrongly."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    torch.manual_seed(1)
    model = perturbed_norms(Gemma2ForCausalLM(Gemma2Config(**SMALL, num_hidden_layers=4, sliding_window=24)))
    return save(model, tmp_path_factory.mktemp("gemma2")), hf_greedy(model, PROMPTS)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    torch.manual_seed(2)
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=6, sliding_window=24, sliding_window_pattern=3,
                              rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=20.0)
    model = perturbed_norms(Gemma3ForCausalLM(config))
    return save(model, tmp_path_factory.mktemp("gemma3")), hf_greedy(model, PROMPTS)


@pytest.mark.parametrize("groups", ["auto", "single"])
def test_gemma2_greedy_equals_transformers(gemma2, groups: str) -> None:
    path, expected = gemma2
    llm = serve("hf", f"model.path={path}", f"allocator.kv_groups={groups}")
    # soft-capped attention: auto picks the one backend that implements it
    assert llm.executor.backend.name == "torch"
    assert llm.executor.layer_windows == (24, None, 24, None)
    assert greedy(llm) == expected


def test_gemma3_greedy_equals_transformers(gemma3) -> None:
    path, expected = gemma3
    llm = serve("hf", f"model.path={path}", "allocator.kv_groups=auto", "kernel.backend=cpu")
    assert llm.executor.kv_layout.num_groups == 3  # two sliding groups of 2 layers, one full group
    assert llm.executor.layer_windows == (24, 24, None, 24, 24, None)
    assert greedy(llm) == expected


def test_qwen2_max_window_layers_greedy_equals_transformers(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=20,
                                         max_window_layers=1)).eval()
    llm = serve("hf", f"model.path={save(model, tmp_path)}")
    assert llm.executor.layer_windows == (None, 20, 20)
    assert greedy(llm) == hf_greedy(model, PROMPTS)
