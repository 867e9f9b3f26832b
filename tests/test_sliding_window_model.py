"""Mistral-style sliding-window attention, end to end: a tiny random `MistralForCausalLM` whose window
is shorter than the prompts, saved as an HF checkpoint and served through the paged cache, generates
HF's greedy tokens on every kernel backend and decode version; and where the window comes from (an
HF config.json, GGUF metadata, `model.sliding_window`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config

from paged import LLM, SamplingParams
from paged.config import ConfigError, KernelConfig, ModelConfig, compose_config, validate
from paged.executor.model_executor import ModelExecutor
from paged.kernels import get_backend
from paged.model.arch import LlamaArch
from paged.model.locate import locate_smollm2
from paged.model.spec import model_spec
from paged.model.tokenizer import load_hf_tokenizer
from tests.test_executor import generate

WINDOW = 16
MAX_NEW = 20
# Prompt lengths around and across the 32-token v2 partitions, all well past the window.
PROMPTS = [
    torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 55, 70)
]
# initializer_range 0.3 makes the logits peaked (std ~3.4): greedy never hinges on a float near-tie.
MISTRAL = dict(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=256, initializer_range=0.3,
    attn_implementation="eager",
)
DECODE_BACKENDS = ["torch", "cpu", "cuda"]


def hf_mistral(sliding_window: int | None, weights: MistralForCausalLM | None = None) -> MistralForCausalLM:
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**MISTRAL, sliding_window=sliding_window)).eval()
    if weights is not None:
        model.load_state_dict(weights.state_dict())
    return model


@pytest.fixture(scope="module")
def hf() -> MistralForCausalLM:
    return hf_mistral(WINDOW)


@pytest.fixture(scope="module")
def checkpoint(hf: MistralForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(path)
    # Prompts are token ids: the tokenizer only has to exist (it decodes outputs to text).
    load_hf_tokenizer(str(locate_smollm2())).save_pretrained(path)
    return path


@torch.inference_mode()
def hf_greedy(model: MistralForCausalLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outputs = [
        model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, eos_token_id=None)
        for p in prompts
    ]
    return [out[0, len(p) :].tolist() for p, out in zip(prompts, outputs, strict=True)]


@pytest.fixture(scope="module")
def expected(hf: MistralForCausalLM) -> list[list[int]]:
    return hf_greedy(hf, PROMPTS, MAX_NEW)


def require(backend: str) -> str:
    """The device the backend's tensors live on; skips where it cannot run."""
    reason = get_backend(backend).unavailable_reason()
    if reason:
        pytest.skip(f"backend={backend} unavailable: {reason}")
    return "cuda" if backend == "cuda" else "cpu"


def serve(checkpoint: Path, backend: str, version: str, num_blocks: int) -> LLM:
    return LLM(
        "hf", allocator="naive", kernel=version,
        overrides=[
            # the HF reference decodes in fp32; model.dtype=auto would be bf16 on a GPU
            f"model.path={checkpoint}", f"model.device={require(backend)}", "model.dtype=float32",
            f"kernel.backend={backend}",
            "kernel.partition_size=32", "allocator.block_size=16", f"allocator.num_blocks={num_blocks}",
        ],
    )


def test_the_window_changes_what_the_model_generates(hf: MistralForCausalLM, expected) -> None:
    full = hf_greedy(hf_mistral(None, weights=hf), PROMPTS, MAX_NEW)
    assert all(a != b for a, b in zip(full, expected, strict=True)), "the test model must depend on the window"


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("num_blocks", [64, 8], ids=["roomy", "preempting"])
def test_engine_greedy_equals_hf_generate(checkpoint: Path, expected, backend: str, version: str,
                                          num_blocks: int) -> None:
    llm = serve(checkpoint, backend, version, num_blocks)
    assert llm.executor.sliding_window == WINDOW
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.compiles
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_emulated_cuda_kernels_generate_hf_tokens(checkpoint: Path, expected, version: str) -> None:
    # fewer prompts and tokens: the emulator runs a block's CUDA threads one after another. The 70-token
    # prompt's window starts past the first v2 partition, which the kernel must skip.
    llm = serve(checkpoint, "emu", version, 16)
    outs = llm.generate(PROMPTS[::2], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    assert [o.token_ids for o in outs] == [e[:8] for e in expected[::2]]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@torch.inference_mode()
def test_prefill_and_decode_logits_match_transformers(checkpoint: Path, hf: MistralForCausalLM, backend: str,
                                                      version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = ModelExecutor(
        ModelConfig(name="mistral", source="hf", path=str(checkpoint), device=require(backend)),
        KernelConfig(name="t", version=version, backend=backend, partition_size=32),
    )
    ex.init_kv_cache(num_blocks=32, block_size=16)
    logits: list[torch.Tensor] = []
    compute_logits = ex.model.compute_logits

    def recorded_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits.append(compute_logits(hidden))
        return logits[-1]

    monkeypatch.setattr(ex.model, "compute_logits", recorded_logits)
    first = [out[0] for out in generate(ex, PROMPTS, 2)]
    prefill, decode = logits
    for i, prompt in enumerate(PROMPTS):
        for ours, ids in ((prefill[i], prompt), (decode[i], [*prompt, first[i]])):
            ref = hf(torch.tensor([ids])).logits[0, -1]
            assert (ours.cpu() - ref).abs().max() / ref.abs().max() < 1e-4


def test_model_sliding_window_overrides_the_checkpoint(checkpoint: Path, hf: MistralForCausalLM) -> None:
    ex = ModelExecutor(
        ModelConfig(name="mistral", source="hf", path=str(checkpoint), device="cpu", sliding_window=8),
        KernelConfig(name="t", backend="torch"),
    )
    ex.init_kv_cache(num_blocks=32, block_size=16)
    assert ex.sliding_window == 8
    assert generate(ex, PROMPTS[:1], 8) == hf_greedy(hf_mistral(8, weights=hf), PROMPTS[:1], 8)


@pytest.mark.parametrize(
    "model, source",
    [("tiny-random", "random"), ("smollm2-135m", "gguf"), ("opt-13b", "spec")],
)
def test_model_sliding_window_applies_to_every_source(model: str, source: str) -> None:
    cfg = compose_config([f"model={model}", "model.sliding_window=64"])
    validate(cfg)
    assert cfg.model.source == source
    spec, _ = model_spec(cfg.model)
    assert spec.sliding_window == 64


@pytest.mark.parametrize("window", [0, -4])
def test_a_non_positive_sliding_window_is_a_config_error(window: int) -> None:
    cfg = compose_config(["model=tiny-random"])
    cfg.model.sliding_window = window
    with pytest.raises(ConfigError, match="model.sliding_window"):
        validate(cfg)


def test_hf_configs_name_their_window_as_transformers_reads_them() -> None:
    def window(config: MistralConfig | Qwen2Config) -> int | None:
        return LlamaArch.from_hf_config(config.to_dict()).sliding_window

    assert window(MistralConfig(**MISTRAL, sliding_window=24)) == 24
    assert window(MistralConfig(**MISTRAL, sliding_window=None)) is None
    small_qwen = dict(MISTRAL, num_hidden_layers=2)
    assert window(Qwen2Config(**small_qwen, sliding_window=24)) is None  # use_sliding_window defaults to off
    assert window(Qwen2Config(**small_qwen, use_sliding_window=True, sliding_window=24, max_window_layers=0)) == 24
    assert window(Qwen2Config(**small_qwen, use_sliding_window=True, sliding_window=24, max_window_layers=2)) is None
    # a window on some layers only: each layer's is in `windows`, and no window is every layer's
    partial = LlamaArch.from_hf_config(
        Qwen2Config(**small_qwen, use_sliding_window=True, sliding_window=24, max_window_layers=1).to_dict())
    assert (partial.sliding_window, partial.windows) == (None, (None, 24))


def test_gguf_metadata_window_is_read_where_present() -> None:
    meta = {
        "general.architecture": "llama", "llama.embedding_length": 128, "llama.feed_forward_length": 256,
        "llama.block_count": 2, "llama.attention.head_count": 2,
    }
    shapes = {"token_embd.weight": (1000, 128)}
    assert LlamaArch.from_gguf_metadata(meta, shapes).sliding_window is None
    assert LlamaArch.from_gguf_metadata({**meta, "llama.attention.sliding_window": 4096}, shapes).sliding_window == 4096
