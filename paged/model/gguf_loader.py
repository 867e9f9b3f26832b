"""Load a Llama-family GGUF file (llama.cpp's format) into an HF-named fp32 state dict."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from paged.model.arch import LlamaArch

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string key/values; arrays (the vocabulary, merges) are the tokenizer's business."""
    return {
        name: f.contents()
        for name, f in reader.fields.items()
        if f.types and f.types[0] is not GGUFValueType.ARRAY
    }


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: not a plain Llama-family weight")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation.

    llama.cpp rotates interleaved pairs (2i, 2i+1); HF rotates halves (i, i + D/2). Its converter
    reorders each head's rows from halves to interleaved; this is the inverse reordering.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_arch(path: str | Path) -> LlamaArch:
    """The architecture alone, from the metadata and tensor shapes (the weights stay on disk)."""
    reader = GGUFReader(str(path))
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    return LlamaArch.from_gguf_metadata(read_metadata(reader), shapes)


def load_gguf(path: str | Path) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
    """Architecture and dequantized fp32 weights, with HF names and HF's Q/K row order."""
    reader = GGUFReader(str(path))
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    meta = read_metadata(reader)
    arch = LlamaArch.from_gguf_metadata(meta, shapes)
    # Only llama.cpp's "llama" converter permutes Q/K; qwen2 is stored in HF order already.
    permuted = meta["general.architecture"] == "llama"
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape(shapes[t.name])
        kind = t.name.rsplit(".", 2)[-2]
        if permuted and kind == "attn_q":
            w = unpermute_rope(w, arch.num_heads)
        elif permuted and kind == "attn_k":
            w = unpermute_rope(w, arch.num_kv_heads)
        state[hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32))
    return arch, state
