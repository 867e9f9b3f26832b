"""transformers' own model of the SmolLM2 GGUF, the reference the real-model tests compare with.

`from_pretrained(gguf_file=...)` insists on `accelerate`, which the project does not need, so the
reference is built the way it would be without it: transformers' GGUF conversion
(`load_gguf_checkpoint`, with its own de-permutation of Q/K) into a `LlamaForCausalLM`.

It is built once per process (a pytest-xdist worker): four test files compare with it, and each
only reads it (eval mode, under `torch.inference_mode`), while building it costs seconds of GGUF
parsing and dequantization.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import gguf
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from paged.model.arch import LlamaArch
from paged.model.locate import locate_smollm2


def arch_kwargs(a: LlamaArch) -> dict[str, Any]:
    """Our parsed architecture as transformers' LlamaConfig keys."""
    return dict(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim, rope_theta=a.rope_theta, rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
    )


def smollm2_reference(a: LlamaArch) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """The reference model in eval mode, and the config transformers read from the GGUF; shared by
    every caller in this process, which must not change it."""
    return _reference(tuple(arch_kwargs(a).items()))


@functools.cache
def _reference(kwargs: tuple[tuple[str, Any], ...]) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    with no_init_weights():
        hf = LlamaForCausalLM(LlamaConfig(**dict(kwargs), bos_token_id=1, eos_token_id=2, pad_token_id=2))
    # transformers maps GGUF names to its own by rebuilding gguf's name map for each of the model's
    # ~400 submodules (most of the conversion's Python time); the map depends only on its arguments
    # (architecture, layer count), so building each one once changes no name
    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        converted = load_gguf_checkpoint(str(locate_smollm2()), return_tensors=True, model_to_load=hf)
    missing, unexpected = hf.load_state_dict(converted["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf.eval(), converted["config"]
