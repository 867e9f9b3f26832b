"""`model.dtype: auto`: the activation dtype a model runs in, resolved for the device it runs on."""

from __future__ import annotations


def bf16_arithmetic_supported() -> bool:
    """Whether this CPU has bf16 arithmetic: AVX512-BF16, or AMX (whose tiles multiply bf16)."""
    import torch  # here, not at import: composing a config does not need torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(name: str, device_type: str) -> str:
    """The torch dtype name `model.dtype=name` means on a device of `device_type` ("cuda", "cpu").

    `auto` is bfloat16 on CUDA: half of float32's bytes for weights, activations and the KV cache at
    float32's exponent range, what vLLM runs bf16 checkpoints in. On a CPU it is bfloat16 where the
    CPU multiplies bf16 natively (AVX512-BF16 or AMX: oneDNN's bf16 GEMMs run at about twice fp32's
    speed there), float32 elsewhere, where bf16 matmuls widen to fp32 and run slower than fp32 itself;
    vLLM's CPU backend chooses so too."""
    if name != "auto":
        return name
    if device_type == "cuda":
        return "bfloat16"
    return "bfloat16" if device_type == "cpu" and bf16_arithmetic_supported() else "float32"


def dtype_note(name: str, device_type: str) -> str:
    """What an executor's description adds to the dtype `model.dtype=name` resolved to: why, when
    `auto` chose it (on a CPU, by its arithmetic); nothing for a dtype named outright."""
    if name != "auto":
        return ""
    if device_type != "cpu":
        return ", auto"
    return f", auto: {'' if bf16_arithmetic_supported() else 'no '}bf16 arithmetic on this CPU"
