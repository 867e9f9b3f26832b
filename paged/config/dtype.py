"""`model.dtype: auto`: the activation dtype a model runs in, resolved for the device it runs on."""

from __future__ import annotations


def resolve_dtype(name: str, device_type: str) -> str:
    """The torch dtype name `model.dtype=name` means on a device of `device_type` ("cuda", "cpu").

    `auto` is bfloat16 on CUDA: half of float32's bytes for weights, activations and the KV cache at
    float32's exponent range, what vLLM runs bf16 checkpoints in. Elsewhere it is float32: not every
    CPU has bf16 arithmetic, and the CPU runs (the default job, the HF parity tests) are fp32."""
    if name != "auto":
        return name
    return "bfloat16" if device_type == "cuda" else "float32"
