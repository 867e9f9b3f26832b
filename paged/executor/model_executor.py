"""The real executor: a Llama-family model whose attention runs through the paged KV cache."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from paged import kernels
from paged.config import KernelConfig, ModelConfig
from paged.executor.attention import BatchInput, PagedAttention, prepare_batch
from paged.executor.base import ExecutorOutput
from paged.model.config import LlamaArch
from paged.model.gguf_loader import load_gguf
from paged.model.hf_loader import load_hf
from paged.model.llama import LlamaModel
from paged.model.locate import locate_smollm2
from paged.model.sampler import SampleRow, sample
from paged.model.tiny import random_state, tiny_arch
from paged.model.tokenizer import load_tokenizer
from paged.scheduler.output import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_weights(model_cfg: ModelConfig) -> tuple[LlamaArch, dict[str, torch.Tensor], Path]:
    """(architecture, HF-named weights, tokenizer source) for `model.source` gguf / hf / random."""
    overrides: dict[str, Any] = (
        OmegaConf.to_container(model_cfg.arch) if isinstance(model_cfg.arch, DictConfig) else dict(model_cfg.arch)
    )
    if overrides and model_cfg.source != "random":
        raise ValueError(f"model.arch only applies to model.source=random, not {model_cfg.source!r}")
    if model_cfg.source == "gguf":
        path = Path(model_cfg.path) if model_cfg.path else locate_smollm2()
        arch, state = load_gguf(path)
        return arch, state, path
    if model_cfg.source == "hf":
        if not model_cfg.path:
            raise ValueError("model.source=hf needs model.path=/path/to/a/local/hf/checkpoint")
        arch, state = load_hf(model_cfg.path)
        return arch, state, Path(model_cfg.path)
    if model_cfg.source == "random":
        arch = tiny_arch(overrides)
        # A fixed weight seed: `tiny-random` is one model whatever the experiment's sampling seed.
        return arch, random_state(arch, seed=0), locate_smollm2()
    raise ValueError(f"model.source={model_cfg.source!r} is not supported; allowed: gguf, hf, random")


class ModelExecutor:
    """Implements `Executor`. Public state: `arch`, `model`, `tokenizer`, `eos_token_id`, `device`,
    `dtype`, `kernel_description`, the per-layer `key_caches` / `value_caches`, and the counters
    `num_prefill_tokens_computed` / `num_decode_tokens_computed` (tokens run through the model in
    prefill / decode steps, so a prefix-cache hit shows up as tokens never computed)."""

    def __init__(self, model_cfg: ModelConfig, kernel_cfg: KernelConfig, seed: int = 0) -> None:
        if model_cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(model_cfg.device)
        self.dtype = DTYPES[model_cfg.dtype]
        self.seed = seed
        arch, state, tokenizer_source = load_weights(model_cfg)
        self.arch = arch
        self.model = LlamaModel(arch, state, self.dtype, self.device)
        self.tokenizer = load_tokenizer(tokenizer_source, chat_template=model_cfg.chat_template)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id: int | None = eos if eos is not None else (arch.eos_token_ids or [None])[0]
        self.scale = arch.head_dim**-0.5

        self._announced: set[str] = set()
        self.configure_kernel(kernel_cfg)
        log.info("model %s on %s (%s); attention %s", model_cfg.name, self.device, model_cfg.dtype,
                 self.kernel_description)

        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.num_prefill_tokens_computed = 0
        self.num_decode_tokens_computed = 0
        # input preparation is engine overhead, not model time; the engine's metrics read this
        self.last_prep_time_s = 0.0

    def configure_kernel(self, kernel_cfg: KernelConfig) -> None:
        """Pick the decode algorithm and backend; an engine reusing this executor calls it again."""
        self.version = kernel_cfg.version
        self.backend = kernels.resolve_backend(kernel_cfg.backend)
        self.partition_size = kernel_cfg.partition_size
        why = {
            "cpu": " (native C++; cuda unavailable)",
            "torch": " (cuda unavailable, native cpu library unavailable)",
        }.get(self.backend, "") if kernel_cfg.backend == "auto" else ""
        version = "auto(v1/v2)" if self.version == "auto" else self.version
        self.kernel_description = f"{version}/{self.backend}{why}"

    def bytes_per_block(self, block_size: int) -> int:
        a = self.arch
        return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """vLLM's layout per layer; zeroed so padding slots a kernel may read hold no NaNs."""
        a = self.arch
        x = 16 // self.dtype.itemsize
        if a.head_dim % x:
            raise ValueError(f"head_dim={a.head_dim} is not a multiple of the key cache's x={x}")
        key_shape = (num_blocks, a.num_kv_heads, a.head_dim // x, block_size, x)
        value_shape = (num_blocks, a.num_kv_heads, a.head_dim, block_size)
        kw = {"dtype": self.dtype, "device": self.device}
        self.key_caches = [torch.zeros(key_shape, **kw) for _ in range(a.num_layers)]
        self.value_caches = [torch.zeros(value_shape, **kw) for _ in range(a.num_layers)]
        self.block_size = block_size

    def _choose_version(self, batch: BatchInput) -> str:
        if self.version != "auto":
            return self.version
        return kernels.choose_version(
            batch.max_seq_len, len(batch.context_lens), self.arch.num_heads, self.partition_size
        )

    def _announce(self, what: str) -> None:
        if what not in self._announced:
            self._announced.add(what)
            log.info("running %s", what)

    def _request_seed(self, item: ScheduledSeq) -> int:
        seed = item.seq.request.params.seed
        if seed is not None:
            return seed
        # Unseeded requests still sample reproducibly under the experiment seed.
        key = f"{self.seed}:{item.seq.request.request_id}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")

    def _sample_rows(self, sched: SchedulerOutput) -> list[SampleRow]:
        return [
            SampleRow(
                params=it.seq.request.params,
                seed=0 if it.seq.request.params.greedy else self._request_seed(it),
                seq_index=it.seq.index,
                num_output_tokens=it.seq.num_output_tokens,
                num_samples=it.num_samples,
            )
            for it in sched.scheduled
            if it.num_samples > 0
        ]

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        assert self.block_size, "init_kv_cache must run before execute"
        start = time.perf_counter()
        if sched.is_empty:
            return ExecutorOutput([], 0, 0.0)
        with torch.inference_mode():
            if sched.blocks_to_copy:
                kernels.copy_blocks(self.key_caches, self.value_caches, sched.blocks_to_copy, backend=self.backend)
            prep_start = time.perf_counter()
            batch = prepare_batch(sched, self.block_size, self.device)
            self.last_prep_time_s = time.perf_counter() - prep_start
            version = self._choose_version(batch) if batch.is_decode else None
            if version:
                self._announce(f"decode: paged_attention {version} on backend {self.backend}")
            else:
                self._announce(f"prefill: gather_kv + prefill_attention, cache writes on backend {self.backend}")
            attn = PagedAttention(
                batch, self.key_caches, self.value_caches, self.scale,
                version=version, backend=self.backend, partition_size=self.partition_size,
            )
            hidden = self.model.forward(batch.input_ids, batch.positions, attn)
            rows = self._sample_rows(sched)
            tokens = sample(self.model.compute_logits(hidden[batch.sample_rows]), rows) if rows else []
        it = iter(tokens)
        sampled = [next(it) if s.num_samples > 0 else [] for s in sched.scheduled]
        if sched.is_prefill:
            self.num_prefill_tokens_computed += batch.num_tokens
        else:
            self.num_decode_tokens_computed += batch.num_tokens
        return ExecutorOutput(sampled, batch.num_tokens, time.perf_counter() - start)
