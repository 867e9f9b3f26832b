"""The values config keys allow, defined once, below the parts that implement them.

The kernels, backends and linear layers import these (so the config schema needs none of them,
and no torch); each part asserts that what it implements matches.
"""

from __future__ import annotations

# kernel.version: the decode kernels: vLLM's v1 / v2 and the GQA-grouped split-KV v3
VERSIONS = ("v1", "v2", "v3")
# kernel.version besides them, a choice per step (paged.kernels.ops): auto (v3 where it was measured to
# win, else vLLM's rule) and vllm (vLLM's rule everywhere: what the paper's system ran)
VERSION_RULES = ("auto", "vllm")
# the activation dtypes the model and the kernels run in
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# model.dtype: one of them, or auto (per device: paged.config.dtype)
MODEL_DTYPES = ("auto", *DTYPE_NAMES)
# allocator.block_size the kernels are instantiated for (executor=sim allows any power of two)
BLOCK_SIZES = (8, 16, 32)
DEFAULT_PARTITION_SIZE = 512
# kernel.backend besides auto (paged.kernels.registry)
BACKENDS = ("torch", "cpu", "cuda", "emu")
# kernel.kv_cache_dtype besides auto (the model dtype): a float dtype of its own, K/V converted as they are
# written (a bf16 model over an fp32 cache), or one-byte KV with per-head scales (paged.kernels.features)
FLOAT_KV_CACHE_DTYPES = ("float32", "bfloat16")
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = (*FLOAT_KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES)
# model.gemm: auto, F.linear, prepacked oneDNN, or paged's packed AVX-512 loop (paged.model.linear)
GEMMS = ("auto", "torch", "onednn", "packed")
# model.source
MODEL_SOURCES = ("gguf", "hf", "random", "spec")
MODEL_DEVICES = ("auto", "cpu", "cuda")
# scheduler keys
PREEMPTION_MODES = ("recompute", "swap", "auto")
BATCH_ORDERS = ("decode-first", "prefill-first")
# workload.kind
WORKLOAD_KINDS = ("synthetic", "fixed", "prompts", "trace", "multiturn", "agent")
# workload.num_requests at most: every request's ids are built before a run (fig16's 3,000 take seconds)
MAX_NUM_REQUESTS = 1_000_000
LOGGER_BACKENDS = ("wandb", "none")
LOGGER_MODES = ("offline", "disabled", "online")
CLUSTER_BACKENDS = ("auto", "local", "ray")
