"""BLOOM (ALiBi) parity with transformers: `model=tiny-bloom`'s seeded random weights in a
`BloomForCausalLM`, saved as an HF checkpoint, loaded by our loader into `BloomModel` and run through
the paged cache (one prefill step for a batch of prompts, then one token per prompt per step), give
HF's logits and greedy tokens; and so does the whole engine serving `model=tiny-bloom`."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM
from transformers.initialization import no_init_weights

from paged import LLM, SamplingParams, kernels
from paged.model.arch import LlamaArch
from paged.model.bloom import BloomModel
from paged.model.factory import build_model
from paged.model.hf_loader import load_hf
from paged.model.llama import AttentionFn
from paged.model.tiny import random_state, tiny_arch

pytestmark = pytest.mark.slow

MAX_NEW = 24
# Across the 16-token cache blocks: shorter than one, ending mid-block, spanning three.
PROMPTS = [torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 21, 40)]
BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8  # 128 positions: the longest prompt and its generation fit
PARTITION_SIZE = 32  # v2 splits contexts past 32 tokens into two partitions
# fp32 throughout: the largest difference seen is 5.7e-6 (torch, cpu) and 7.6e-6 (cuda) in logits of
# std ~3, whose top two differ by 0.013 at least in every step.
LOGITS_ATOL = 1e-4
BACKENDS = ["torch", "cpu", "cuda"]


def hf_bloom(arch: LlamaArch) -> BloomForCausalLM:
    """transformers' BLOOM holding `random_state(arch)`: for `tiny_arch({"architecture": "bloom"})`,
    the weights `model=tiny-bloom` builds."""
    config = BloomConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, n_layer=arch.num_layers, n_head=arch.num_heads,
        layer_norm_epsilon=arch.rms_norm_eps, tie_word_embeddings=arch.tie_word_embeddings,
    )
    with no_init_weights():
        model = BloomForCausalLM(config)
    missing, unexpected = model.load_state_dict(random_state(arch, seed=0), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def save(hf: BloomForCausalLM, path: Path) -> Path:
    hf.save_pretrained(path)
    return path


def ours(checkpoint: Path, device: str = "cpu") -> BloomModel:
    """A saved `BloomForCausalLM` read back by our loader."""
    arch, state = load_hf(checkpoint)
    model = build_model(arch, state, torch.float32, torch.device(device))
    assert isinstance(model, BloomModel)
    return model


@torch.inference_mode()
def hf_greedy(model: BloomForCausalLM, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and each step's logits `[max_new, vocab]`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no pad token: irrelevant for one unpadded prompt
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=None,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


def require(backend: str) -> str:
    """The device the backend's tensors live on; skips where it cannot run ALiBi."""
    impl = kernels.get_backend(backend)
    # features first: it is free, where availability may build the backend
    if "alibi" not in impl.features:
        pytest.skip(f"backend={backend} does not implement ALiBi yet (features={impl.features})")
    reason = impl.unavailable_reason()
    if reason:
        pytest.skip(f"backend={backend} unavailable: {reason}")
    return "cuda" if backend == "cuda" else "cpu"


class Step(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionFn
    last_rows: torch.Tensor  # each sequence's last row: the one that samples


class PagedCache:
    """A per-layer paged KV cache for a few sequences, each owning `BLOCKS_PER_SEQ` consecutive blocks."""

    def __init__(self, model: BloomModel, num_seqs: int, backend: str, version: str) -> None:
        a = model.arch
        x = 16 // model.dtype.itemsize
        num_blocks = num_seqs * BLOCKS_PER_SEQ
        kw = {"dtype": model.dtype, "device": model.device}
        self.keys = [torch.zeros(num_blocks, a.num_heads, a.head_dim // x, BLOCK_SIZE, x, **kw)
                     for _ in range(a.num_layers)]
        self.values = [torch.zeros(num_blocks, a.num_heads, a.head_dim, BLOCK_SIZE, **kw) for _ in range(a.num_layers)]
        self.tables = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, BLOCKS_PER_SEQ)
        self.scale = a.head_dim**-0.5
        self.slopes = model.alibi_slopes
        self.backend, self.version, self.device = backend, version, model.device

    def step(self, seqs: list[list[int]], computed: list[int], prefill: bool) -> Step:
        """The model inputs for the tokens of each sequence past `computed`, and the attention over them."""
        new = [s[c:] for s, c in zip(seqs, computed)]
        num_new = torch.tensor([len(n) for n in new])
        positions = torch.cat([torch.arange(c, len(s)) for s, c in zip(seqs, computed)])
        owner = torch.repeat_interleave(torch.arange(len(seqs)), num_new)
        slots = self.tables[owner, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        seq_lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        starts = torch.cat([torch.zeros(1), num_new.cumsum(0)]).int()
        slots, seq_lens, starts, tables = (t.to(self.device) for t in (slots, seq_lens, starts, self.tables))
        common = {"backend": self.backend, "alibi_slopes": self.slopes}

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.keys[layer], self.values[layer]
            kernels.reshape_and_cache(k, v, kc, vc, slots, backend=self.backend)
            if prefill:
                return kernels.prefill_attention(q, kc, vc, tables, starts, seq_lens, self.scale, **common)
            return kernels.paged_attention(q, kc, vc, tables, seq_lens, self.scale, version=self.version,
                                           partition_size=PARTITION_SIZE, **common)

        ids = torch.tensor([t for n in new for t in n])
        return Step(ids.to(self.device), positions.to(self.device), attn, starts[1:].long() - 1)


@torch.inference_mode()
def paged_greedy(
    model: BloomModel, prompts: list[list[int]], max_new: int, backend: str, version: str = "v1"
) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per prompt and (CPU) logits `[prompts, max_new, vocab]` through a paged cache:
    every prompt prefilled in one step, then one decode step per token."""
    cache = PagedCache(model, len(prompts), backend, version)
    seqs = [list(p) for p in prompts]
    computed = [0] * len(seqs)
    logits = []
    for step in range(max_new):
        inputs = cache.step(seqs, computed, prefill=step == 0)
        hidden = model.forward(inputs.input_ids, inputs.positions, inputs.attn)
        logits.append(model.compute_logits(hidden[inputs.last_rows]).cpu())
        computed = [len(s) for s in seqs]
        for s, token in zip(seqs, logits[-1].argmax(-1).tolist()):
            s.append(token)
    return [s[len(p) :] for s, p in zip(seqs, prompts)], torch.stack(logits, dim=1)


@pytest.fixture(scope="module")
def hf() -> BloomForCausalLM:
    return hf_bloom(tiny_arch({"architecture": "bloom"}))


@pytest.fixture(scope="module")
def checkpoint(hf: BloomForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(hf, tmp_path_factory.mktemp("bloom"))


@pytest.fixture(scope="module")
def expected(hf: BloomForCausalLM) -> list[tuple[list[int], torch.Tensor]]:
    return [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_tiny_bloom_generates_from_its_context(expected) -> None:
    # an untied head: a random tied BLOOM echoes its last token, which no cache bug would change
    tokens = [t for t, _ in expected]
    assert all(len(set(t)) > MAX_NEW // 2 for t in tokens) and tokens[0] != tokens[1]


def test_hf_config_reads_as_bloom(checkpoint: Path) -> None:
    # BLOOM has no position limit to read: the default stands
    expected_arch = dataclasses.replace(tiny_arch({"architecture": "bloom"}), max_position_embeddings=2048)
    assert ours(checkpoint).arch == expected_arch


@pytest.mark.parametrize(
    "extra",
    [{"n_embed": 256, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3},
     {"hidden_size": 256, "n_head": 4, "n_layer": 3}],
    ids=["old-keys", "new-keys"],
)
def test_bloom_config_keys_read_as_transformers_reads_them(extra: dict) -> None:
    cfg = {"model_type": "bloom", "vocab_size": 100, **extra}
    ref = BloomConfig.from_dict(cfg)
    arch = LlamaArch.from_hf_config(cfg)
    assert (arch.hidden_size, arch.num_heads, arch.num_layers) == (ref.hidden_size, ref.n_head, ref.n_layer)
    assert (arch.head_dim, arch.intermediate_size, arch.num_kv_heads) == (64, 1024, 4)


def test_post_layernorm_residuals_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="apply_residual_connection_post_layernorm"):
        LlamaArch.from_hf_config({"model_type": "bloom", "apply_residual_connection_post_layernorm": True})


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_logits_and_greedy_tokens_match_hf(checkpoint: Path, expected, backend: str, version: str) -> None:
    device = require(backend)
    tokens, logits = paged_greedy(ours(checkpoint, device), PROMPTS, MAX_NEW, backend, version)
    assert tokens == [t for t, _ in expected]
    for i, (_, ref) in enumerate(expected):
        assert (logits[i] - ref).abs().max() < LOGITS_ATOL


def test_tied_lm_head_logits_match_hf(tmp_path: Path) -> None:
    # BLOOM's own checkpoints tie the head to the embeddings: the logits, not the (echoing) tokens, tell
    hf = hf_bloom(tiny_arch({"architecture": "bloom", "tie_word_embeddings": True}))
    model = ours(save(hf, tmp_path))
    assert model.lm_head is model.embed
    prompts = PROMPTS[1:]
    _, logits = paged_greedy(model, prompts, 4, "torch")
    for i, prompt in enumerate(prompts):
        _, ref = hf_greedy(hf, prompt, 4)
        assert (logits[i] - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_serving_tiny_bloom_generates_hf_tokens(expected, backend: str) -> None:
    device = require(backend)
    llm = LLM("tiny-bloom", overrides=[f"model.device={device}", f"kernel.backend={backend}"])
    assert llm.executor.alibi_slopes is not None
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [t for t, _ in expected]
