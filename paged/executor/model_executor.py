"""The real executor: a Llama-family model whose attention runs through the paged KV cache.

With `tensor_parallel_size` > 1 this executor is rank 0 of a tensor-parallel group: it plans each
step and samples, and every rank (this one and the worker processes of
`paged.executor.tp_workers`) runs the step's swaps, copies and forward over its shard of the heads
(`paged.model.tensor_parallel`), each KV cache holding its ranks' heads under the same block ids.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from paged import kernels, threads
from paged.config import KernelConfig, ModelConfig, dtype_note, resolve_dtype
from paged.executor import memory_profile
from paged.executor.attention import PagedAttention, layer_routes
from paged.executor.attention_scores import StepScores
from paged.executor.base import Executor, KVCacheSpec
from paged.executor.block_moves import move_blocks
from paged.executor.description import announce_once, describe
from paged.executor.dtype_checks import check_dtypes
from paged.executor.kv_norms import held_kv_norms
from paged.executor.kv_scales import KVScales
from paged.executor.kv_tensors import allocate_kv, kv_block_spec
from paged.executor.launch_ahead import LaunchAhead
from paged.executor.layer_types import LayerTypes, check_kv_layout
from paged.executor.model_checks import check_before_load, check_positions
from paged.executor.persistent_batch import PersistentBatch
from paged.executor.sample_inputs import prompt_logprobs
from paged.executor.step_graphs import StepGraphs
from paged.executor.step_plan import BatchInput, HostBatch, InputBuffers, plan_batch
from paged.executor.step_sampling import sample_step
from paged.executor.tier_files import TieredHostPool
from paged.executor.tp_workers import RankStep, WorkerGroup, on_every_rank
from paged.kernels.features import AttentionFeatures, BlockSparse, cache_dtype, is_fp8
from paged.kernels.forward_context import forward_context
from paged.kernels.planned import AttentionSettings
from paged.kv_layout import KVLayout
from paged.model.factory import build_model
from paged.model.layer_ops import layer_ops_for
from paged.model.linear import resolve_gemm
from paged.model.llama import LlamaModel
from paged.model.tensor_parallel import shard_model
from paged.model.tokenizer import load_tokenizer
from paged.model.weights import load_weights
from paged.step import ExecutorOutput, SchedulerOutput

log = logging.getLogger(__name__)

# Graphs are planned for the scheduler's limits (`set_batch_limits`); these when none are given.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096

class ModelExecutor(TieredHostPool, LaunchAhead, Executor):
    """A Llama-family model on CPU or CUDA. Public state besides the `Executor` contract: `arch`,
    `model`, `device`, `dtype`, `kernel_description`, `prefill_path` (how the backend's prefill
    computes, or None), `threads` (the CPU threads `paged.utils.threads`
    chose, per rank), `sliding_window` (the attention window in
    tokens, `None` for the whole context), the per-layer `key_caches` / `value_caches` and their
    host-memory swap space `cpu_key_caches` / `cpu_value_caches`, and the counters
    `num_prefill_tokens_computed` / `num_decode_tokens_computed` (tokens run through the model for
    prompts / for generated tokens, so a prefix-cache hit shows up as tokens never computed).
    Under tensor parallelism `rank` is this process's rank, `num_devices` the number of ranks,
    `shard` the architecture of this rank's shard (`arch` at size 1), whose heads the caches hold,
    and `workers` the other ranks (None at size 1 and in a worker)."""

    supports_swap = True
    supports_kv_press = True

    def __init__(
        self, model: ModelConfig, kernel: KernelConfig, seed: int = 0, cuda_graphs: bool | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """`cuda_graphs`: replay steps from CUDA graphs (`paged.executor.cuda_graphs`, `.mixed_graphs`); `None`
        is on for a CUDA model and off elsewhere. `tensor_parallel_size`: ranks to split the model's
        heads and MLP over, this process and `tensor_parallel_size - 1` workers (1: no split)."""
        self._setup(model, kernel, seed, cuda_graphs, tensor_parallel_size, rank=0, group=None)

    @classmethod
    def rank_shard(
        cls, rank: int, group: Any, model: ModelConfig, kernel: KernelConfig, seed: int, size: int
    ) -> ModelExecutor:
        """Rank `rank`'s executor in a tensor-parallel worker, reducing over `group`."""
        executor = cls.__new__(cls)
        executor._setup(model, kernel, seed, False, size, rank=rank, group=group)
        return executor

    def _setup(
        self, model_cfg: ModelConfig, kernel_cfg: KernelConfig, seed: int, cuda_graphs: bool | None, size: int,
        rank: int, group: Any,
    ) -> None:
        self.rank, self.num_devices = rank, size
        self.workers: WorkerGroup | None = None
        if model_cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(model_cfg.device)
        if rank == 0:
            check_before_load(model_cfg, kernel_cfg, cuda_graphs, size, self.device)
        if size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", rank)
        self.use_cuda_graphs = self.device.type == "cuda" and size == 1 if cuda_graphs is None else cuda_graphs
        self.cuda_graphs_requested = cuda_graphs
        # before the weights load, which runs on these threads too
        self.threads = threads.configure(model_cfg.num_threads, ranks=size)
        self.dtype: torch.dtype = getattr(torch, resolve_dtype(model_cfg.dtype, self.device.type))
        self.dtype_note = dtype_note(model_cfg.dtype, self.device.type)
        self.seed = seed
        # checked before the weights load, so a bad value fails at once (dtypes on rank 0: it warns once per run)
        if rank == 0:
            check_dtypes(self.dtype, kernel_cfg, self.device)
        self.gemm = resolve_gemm(model_cfg.gemm, self.dtype, self.device)
        self.native_decode = model_cfg.native_decode  # a decode step's layers in one call (paged.model.decode_layers)
        workers = None
        if size > 1 and rank == 0:  # they load their shards while this process loads its own
            workers = WorkerGroup(size, self.device.type, type(self).rank_shard, (model_cfg, kernel_cfg, seed, size))
            group = workers.group
        try:
            self._load(model_cfg, kernel_cfg, group)
        except BaseException:
            if workers is not None:
                workers.close(wait_s=0.0)
            raise
        if workers is not None:
            workers.replies()  # each worker built its shard
            self.workers = workers

    def _load(self, model_cfg: ModelConfig, kernel_cfg: KernelConfig, group: Any) -> None:
        arch, state, tokenizer_source = load_weights(model_cfg, self.device, self.dtype)
        self.arch = arch
        # the embedding's rows: a prompt's token ids must be below it (the LLM API checks them)
        self.vocab_size = arch.vocab_size
        self.model = build_model(arch, state, self.dtype, self.device, self.gemm) if self.num_devices == 1 else (
            shard_model(arch, state, self.rank, self.num_devices, group, self.dtype, self.device, self.gemm))
        self.shard = self.model.arch
        # a worker never tokenizes or samples: it skips the seconds of importing transformers for one
        if self.rank == 0:
            self.tokenizer = load_tokenizer(tokenizer_source, chat_template=model_cfg.chat_template)
            eos = self.tokenizer.eos_token_id
            self.eos_token_ids = frozenset([eos] if eos is not None else arch.eos_token_ids[:1])
        self.model_name = model_cfg.name
        self.scale = arch.softmax_scale
        self.sliding_window = arch.sliding_window  # None where layers' windows differ (LlamaArch.layer_windows)
        self.layer_windows = arch.windows
        self.layer_types = LayerTypes.of(self.layer_windows)
        self.kv_layout = KVLayout.build(self.layer_windows, "single")
        self.routes = layer_routes(self.kv_layout, self.layer_types.kind_of_layer)
        # ALiBi models (BLOOM) carry their slopes; RoPE models have none
        self.alibi_slopes: torch.Tensor | None = getattr(self.model, "alibi_slopes", None)
        self.kv_scales: KVScales | None = None

        self._announced: set[str] = set()
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        self.cpu_key_caches: list[torch.Tensor] = []
        self.cpu_value_caches: list[torch.Tensor] = []
        self.block_size = 0
        # a decode batch's inputs kept across steps (`init_kv_cache` makes it for the cache's block size)
        self.persistent_batch = PersistentBatch(1)
        self.max_num_seqs, self.max_model_len = DEFAULT_MAX_NUM_SEQS, arch.max_position_embeddings
        self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.inputs = InputBuffers(self.device)
        self.step_graphs = StepGraphs()
        # async scheduling: the tokens the last launched step sampled, one per sampling row, where the
        # next step's inputs read them (`_forward`); None when off
        self.sampled_ids: torch.Tensor | None = None
        self.compaction_time_s = 0.0  # KV compaction copies since the last step's output (`move_blocks`)
        self.step_scores: StepScores | None = None  # the attention mass a scoring press reads of this step
        self.configure_kernel(kernel_cfg)
        log.info("model %s on %s (%s) loaded", model_cfg.name, self.device, str(self.dtype).removeprefix("torch."))
        self.num_prefill_tokens_computed = self.num_decode_tokens_computed = 0

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.close()

    @property
    def description(self) -> str:
        return describe(self)

    @on_every_rank()
    def configure_kernel(self, kernel_cfg: KernelConfig) -> None:
        """Pick the decode algorithm, the KV cache's dtype and the attention features, and the
        backend once for this model's device, dtype and head size; an engine reusing this executor
        calls it again (before `init_kv_cache`), and every rank with it."""
        self.version = kernel_cfg.version
        self.partition_size = kernel_cfg.partition_size
        self.requested_backend = kernel_cfg.backend
        self.kv_cache_dtype_name = kernel_cfg.kv_cache_dtype
        self.cache_dtype = cache_dtype(kernel_cfg.kv_cache_dtype, self.dtype)
        self.k_scale, self.v_scale = kernel_cfg.k_scale, kernel_cfg.v_scale
        sparse = kernel_cfg.blocksparse
        self.blocksparse = BlockSparse.from_config(dict(sparse)) if sparse else None
        self._resolve_backend()

    @property
    def _v2_partition_size(self) -> int | None:
        return self.partition_size if self.version in ("v2", "auto") else None

    def _resolve_backend(self) -> None:
        """The backend for this model's device, dtype and head size, and the cache's block size once
        it is known (every op checks it again)."""
        self.backend, reason = kernels.resolve_backend(
            self.requested_backend, device=self.device, dtype=self.dtype, head_size=self.arch.head_dim,
            block_size=self.block_size or None, partition_size=self._v2_partition_size,
            cache_dtype=self.cache_dtype, features=self._features,
        )
        # what auto picks here: v3 on a backend it was measured to win on, else vLLM's v1/v2 rule
        picks = "v3" if self.backend.name in kernels.V3_BACKENDS else "v1/v2"
        version = {"auto": f"auto({picks})", "vllm": "vllm(v1/v2)"}.get(self.version, self.version)
        self.kernel_description = f"{version}/{reason}"
        self.prefill_path = self.backend.prefill_path(self.dtype, self.arch.head_dim, self.device, self.cache_dtype)
        if isinstance(self.model, LlamaModel):
            self.model.ops = layer_ops_for(self.backend)
        self.attention = [
            AttentionSettings(self.backend, self.scale, self.partition_size, window, self.alibi_slopes,
                              self.blocksparse, self.arch.attn_logit_softcapping, self.cache_dtype)
            for window in self.layer_types.windows
        ]

    @property
    def _features(self) -> AttentionFeatures:
        return AttentionFeatures(self.alibi_slopes, self.blocksparse, self.arch.attn_logit_softcapping)

    def set_kv_layout(self, layout: KVLayout) -> None:
        """Route each layer to its group's tables and KV tensor (`check_kv_layout` refuses what cannot
        run; with `cuda_graphs` unset, KV groups turn the graphs off)."""
        check_kv_layout(layout, self.layer_windows, self.num_devices, self.cuda_graphs_requested)
        requested = self.cuda_graphs_requested
        default = self.device.type == "cuda" and self.num_devices == 1
        self.use_cuda_graphs = (default if requested is None else requested) and not layout.is_hybrid
        self.kv_layout = layout
        self.routes = layer_routes(layout, self.layer_types.kind_of_layer)

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        """A block's bytes over all ranks (`paged.executor.kv_tensors`); the swap space is
        `allocator.swap_space` per rank."""
        return kv_block_spec(self.shard, self.kv_layout, self.num_devices, block_size, self.cache_dtype)

    @on_every_rank(lambda executor, mine, theirs: None if mine is None else min(mine, *theirs) * executor.num_devices)
    def kv_cache_budget(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int | None:
        """On CUDA: `utilization` of the device's memory, less what is in use with the weights loaded
        and the activation peak of a dummy largest step (`paged.executor.memory_profile`). None on a
        CPU: the cache there takes host memory, which has no share to size it from. Under tensor
        parallelism, the smallest rank's budget times the ranks (a block's bytes count all ranks); a
        worker answers for its own device."""
        if self.device.type != "cuda":
            return None
        # an engine reusing this executor replaces the cache next: free it (and the graphs that read
        # it) now, so it neither counts as in use nor lives beside its replacement
        self.key_caches, self.value_caches, self.step_graphs = [], [], StepGraphs()
        return memory_profile.kv_budget(self.model, self.device, utilization, max_num_batched_tokens, max_num_seqs,
                                        self.arch.max_position_embeddings)

    @on_every_rank()
    def init_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """vLLM's layout per KV slot (a layer, with one KV group; `paged.executor.kv_tensors`). Every
        rank allocates its KV heads' share of each block."""
        a = self.shard
        if self.blocksparse is not None:
            self.blocksparse.check(block_size)
        (self.key_caches, self.value_caches), (self.cpu_key_caches, self.cpu_value_caches) = allocate_kv(
            a, self.kv_layout.num_slots, num_blocks, num_cpu_blocks, block_size, self.cache_dtype, self.device)
        self.block_size = block_size
        # a new cache's blocks: nothing kept from steps on the old one
        self.persistent_batch = PersistentBatch(block_size)
        self.kv_scales = (
            KVScales(a.num_layers, a.num_kv_heads, self.cache_dtype, self.device, self.k_scale, self.v_scale)
            if is_fp8(self.cache_dtype) else None
        )
        # resolved without a block size at construction: resolve again only if this one is refused
        if self.backend.unsupported_reason(
            self.device, self.dtype, self.arch.head_dim, block_size, self._v2_partition_size, self.cache_dtype,
            self._features,
        ):
            self._resolve_backend()
        # before the graphs, which read it at a fixed address; a step samples at most one row per sequence
        self.sampled_ids = (torch.zeros(self.max_num_seqs, dtype=torch.long, device=self.device)
                            if self.async_scheduling else None)
        # a new cache is a new engine's: its summary counts its own steps
        self.step_graphs = self._make_graphs()

    def set_batch_limits(self, max_num_seqs: int, max_model_len: int,
                         max_num_batched_tokens: int | None = None) -> None:
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

    def decode_step_counts(self) -> dict[str, int | None]:
        return self.step_graphs.counts()

    @property
    def graphs(self) -> Any:
        """The decode graphs (`DecodeGraphs`); None when steps run eagerly."""
        return self.step_graphs.decode

    def _make_graphs(self) -> StepGraphs:
        """Graphs for this cache and kernel (none when off or not capturable); any captured before
        read the caches they replaced."""
        if not self.use_cuda_graphs:
            return StepGraphs()
        if not self.backend.graph_capturable:
            log.warning("executor.cuda_graphs: kernel backend %s cannot be captured in a CUDA graph (it reads values "
                        "on the host or skips padding there), so steps run eagerly", self.backend.name)
            return StepGraphs()
        return StepGraphs.capture_on_demand(self._forward, self.device, self.max_num_seqs, self.max_num_batched_tokens,
                                            self.max_model_len, self.block_size)

    def _choose_version(self, batch: HostBatch) -> str | None:
        """The decode kernel for the step's decode rows; `None` when it has none."""
        rows = batch.decode
        if rows is None:
            return None
        # a windowed row reads at most the window: that is the length the kernels' work scales with
        attended = min(rows.max_seq_len, self.layer_types.widest_window or rows.max_seq_len)
        return kernels.step_version(self.version, attended, rows.seq_lens.shape[0], self.shard.num_heads,
                                    self.partition_size, backend=self.backend.name)

    def _forward(self, batch: BatchInput, version: str | None) -> torch.Tensor:
        """The hidden states of a step's rows: attention planned once, which the layers' torch op runs."""
        if version:
            announce_once(self._announced, f"decode rows: paged_attention {version} on backend {self.backend.name}")
        if batch.prefill:
            announce_once(self._announced, f"prefill rows: prefill_attention on backend {self.backend.name}")
        input_ids = batch.input_ids
        if self.sampled_ids is not None:
            # async scheduling: id -(1 + r) is a placeholder for the token that sampling row r of the step
            # before drew, which the host has not read yet (`Scheduler.commit_scheduled`)
            input_ids = torch.where(input_ids < 0, self.sampled_ids[(-1 - input_ids).clamp_(min=0)], input_ids)
        attention = PagedAttention(batch, self.key_caches, self.value_caches, self.attention, decode_version=version,
                                   num_heads=self.shard.num_heads, kv_scales=self.kv_scales, routes=self.routes,
                                   scores=self.step_scores)
        with forward_context(attention, attention.stack_attention() if self.native_decode else None):
            return self.model.forward(input_ids, batch.positions)

    def _run(self, host: HostBatch, version: str | None) -> tuple[torch.Tensor, BatchInput]:
        """A step from its CUDA graph where one replays it, else eagerly."""
        replayed = None if self.step_scores else self.step_graphs.replay(host, version)  # graphs score nothing
        if replayed is not None:
            return replayed
        batch = self.inputs.upload(host)
        return self._forward(batch, version), batch

    @on_every_rank(wait=False)
    def run_rank_step(self, step: RankStep) -> tuple[torch.Tensor, BatchInput] | None:
        """This rank's part of a step: swaps, copies, then the forward over its heads; the hidden
        states and inputs of the batch (None for a step of swaps only)."""
        with torch.inference_mode():
            self.compaction_time_s += move_blocks(step, self.key_caches, self.value_caches, self.cpu_key_caches,
                                                  self.cpu_value_caches, self.backend)
            return None if step.batch is None else self._run(step.batch, step.decode_version)

    def _compute(self, sched: SchedulerOutput) -> tuple[HostBatch, str | None, torch.Tensor, BatchInput, float] | None:
        """Plan the step, then its swaps, copies and forward: the batch, its decode kernel, the hidden
        states, the inputs on the device and the planning time; None for a step of swaps only."""
        assert self.block_size, "init_kv_cache must run before execute"
        start, host, version, self.step_scores = time.perf_counter(), None, None, StepScores.of(sched, self.kv_layout)
        if not sched.is_empty:
            host = self.persistent_batch.plan(sched)
            if host is None:
                host = plan_batch(sched, self.block_size, self.kv_layout.num_groups, self.kv_layout.full_groups)
                self.persistent_batch.keep(sched, host)
            check_positions(host, self.arch)
            version = self._choose_version(host)
        prep_time = time.perf_counter() - start
        # the prefix tiers' host blocks follow the swap pool's: their copies go out and in with the swaps
        ran = self.run_rank_step(RankStep(
            sched.blocks_to_offload + sched.blocks_to_swap_out, sched.blocks_to_swap_in + sched.blocks_to_onload,
            sched.blocks_to_copy, host, version, sched.slots_to_compact))
        if ran is None or host is None:
            return None
        return host, version, *ran, prep_time

    def _count_tokens(self, host: HostBatch) -> None:
        # a decode token extends a generation; everything else computes a prompt (or recomputes one)
        self.num_decode_tokens_computed += host.num_decode_tokens
        self.num_prefill_tokens_computed += host.num_tokens - host.num_decode_tokens

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        start = time.perf_counter()
        ran = self._compute(sched)
        if ran is None:
            return ExecutorOutput([], model_time_s=time.perf_counter() - start)
        host, version, hidden, batch, prep_time = ran
        with torch.inference_mode():
            output = sample_step(self.model, sched, hidden, batch, self.seed, self.eos_token_ids,
                                 argmax=self.persistent_batch.argmax)
            output.prompt_logprobs = prompt_logprobs(sched, hidden, self.model.compute_logits)
            if sched.press_norms and sched.press_rows:
                output.kv_norms = held_kv_norms(sched, self.key_caches, self.value_caches, self.block_size,
                                               self.kv_layout)
            output.attention_scores = self.step_scores.scores(sched) if self.step_scores else {}
        self._count_tokens(host)
        output.compaction_time_s, self.compaction_time_s = self.compaction_time_s, 0.0
        output.num_computed_tokens, output.prep_time_s, output.attention_version = host.num_tokens, prep_time, version
        output.model_time_s = time.perf_counter() - start - prep_time
        return output
