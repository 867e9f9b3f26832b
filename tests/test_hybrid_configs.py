"""Per-layer attention types as `LlamaArch` reads them from HF configs (as transformers' own config
classes save them), what it refuses, and `model.sliding_window` / `model.arch.layer_windows` on the
config side."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, Gemma3TextConfig, Qwen2Config

from paged.config import compose_config, validate
from paged.model.arch import LlamaArch
from paged.model.weights import load_arch

SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, max_position_embeddings=512)


def arch(config: object) -> LlamaArch:
    return LlamaArch.from_hf_config(config.to_dict())  # type: ignore[attr-defined]


def test_gemma2_alternates_sliding_and_full_layers_and_soft_caps() -> None:
    a = arch(Gemma2Config(**SMALL, num_hidden_layers=4, sliding_window=64))
    assert a.architecture == "gemma" and a.windows == (64, None, 64, None) and a.sliding_window is None
    assert (a.attn_logit_softcapping, a.final_logit_softcapping) == (50.0, 30.0)
    assert a.softmax_scale == 256**-0.5 and a.tie_word_embeddings and not a.qk_norm
    assert (a.rope_theta, a.rope_local_theta, a.rope_linear_factor) == (10_000.0, None, 1.0)


def test_gemma3_reads_its_pattern_two_ropes_and_q_k_norms() -> None:
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=6, sliding_window=32, sliding_window_pattern=3,
                              query_pre_attn_scalar=64, rope_scaling={"rope_type": "linear", "factor": 8.0})
    a = arch(config)
    assert a.windows == (32, 32, None, 32, 32, None)
    assert a.qk_norm and a.softmax_scale == 64**-0.5
    assert (a.rope_theta, a.rope_local_theta, a.rope_linear_factor) == (1_000_000.0, 10_000.0, 8.0)
    # transformers' Gemma-3 attention ignores attn_logit_softcapping, so the model does too
    assert a.attn_logit_softcapping is None and a.final_logit_softcapping is None
    # configs written before transformers 5 spell the RoPEs as flat keys
    old = {**config.to_dict(), "rope_parameters": None, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
           "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    b = LlamaArch.from_hf_config(old)
    assert (b.rope_theta, b.rope_local_theta, b.rope_linear_factor) == (5e5, 2e4, 2.0)


def test_qwen2_windows_the_layers_from_max_window_layers() -> None:
    a = arch(Qwen2Config(**SMALL, num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert a.windows == (None, 16, 16, 16) and a.sliding_window is None
    layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    b = arch(Qwen2Config(**SMALL, num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                         layer_types=layer_types))
    assert b.windows == (None, 16, None, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma3"}, "only its text model is supported"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "rope scaling 'yarn'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not implemented"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not implemented"),
        ({"layer_types": ["chunked_attention"] * 2}, r"layer_types \['chunked_attention'\] are not implemented"),
        ({"layer_types": ["full_attention"]}, "layer_types names 1 layers but num_hidden_layers=2"),
    ],
)
def test_what_the_gemma_decoder_does_not_run_is_refused(change: dict, message: str) -> None:
    config = {**Gemma3TextConfig(**SMALL, num_hidden_layers=2).to_dict(), **change}
    with pytest.raises((ValueError, NotImplementedError), match=message):
        LlamaArch.from_hf_config(config)


def test_equal_layer_windows_fold_into_sliding_window() -> None:
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=1, num_kv_heads=1,
                head_dim=8)
    assert LlamaArch(**base, layer_windows=[16, 16]).sliding_window == 16
    assert LlamaArch(**base, layer_windows=[16, 16]).layer_windows is None
    assert LlamaArch(**base, sliding_window=8, layer_windows=[None, 16]).windows == (None, 16)
    with pytest.raises(ValueError, match="must list one window per layer"):
        LlamaArch(**base, layer_windows=[16])
    with pytest.raises(ValueError, match="entry 0 must be a positive integer"):
        LlamaArch(**base, layer_windows=[0, None])
    with pytest.raises(ValueError, match="qk_norm apply to architecture=gemma only"):
        LlamaArch(**base, qk_norm=True)


def test_tiny_hybrid_and_the_window_override() -> None:
    cfg = compose_config(["model=tiny-hybrid"])
    validate(cfg)
    assert load_arch(cfg.model)[0].windows == (None, None, 32, 32, 32, 32)
    # model.sliding_window puts its window on every layer, a model whose layers differ included
    cfg = compose_config(["model=tiny-hybrid", "model.sliding_window=64"])
    assert load_arch(cfg.model)[0].windows == (64,) * 6
