"""The roofline cost of one engine step on the simulated GPUs, layer by layer.

Every operator costs the larger of its FLOPs over (peak x efficiency) and its bytes over
(bandwidth x efficiency): compute and memory traffic overlap, as in LLM-Viewer and llm-analysis.
Per layer (all layers are alike, so one layer is costed and multiplied):

- linear layers: 2 x tokens x weights FLOPs, against weight bytes plus activations in and out; the
  matmul efficiency depends on the number of tokens (a measured table, and on a GPU the share of
  SMs a GEMM's output tiles keep busy), so a small batch is bandwidth-bound;
- attention per layer type: a model whose layers attend within different windows (Gemma-2/3) has
  each window's layers costed with that window's reads, and their layers summed;
- prefill attention: 4 x head_dim x heads FLOPs for every (query, key) pair a causal prefill of
  the uncached tokens computes against the sequence's full context (cached prefix included);
- decode attention: each sequence reads its K and V for its real context length, and the step
  cannot end before the kernel's largest work unit streams at one SM's share of the bandwidth
  (`decode_attention.py`: v1, v2 and v3's units and merges), at the efficiency the hardware's
  kernel table gives the variant and the batch's shape class (`kernel_table.py`: measured where
  a kernel benchmark exists, its source stated per row), so `kernel=v1|v2|v3` prices that kernel;
- layer norms, residual adds, rotary, the MLP activation and the KV-cache write: memory-bound;
- the KV cache's element size (`kv_dtype_bytes`: 1 for an fp8 cache) prices every byte of K/V that
  attention reads from the cache, the cache write stores and a swap moves; weights and activations
  stay at the model's `dtype_bytes`;
- tensor parallelism splits weights and heads over `num_gpus` and adds two ring all-reduces of
  the hidden states per layer over the interconnect;
- launches: a layer cannot run faster than its kernels can be launched.

Around the layers: the embedding gather, the LM head for the rows that sample, sampling, and the
host's per-step and per-sequence overhead (scheduling, input preparation, output processing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paged.config.choices import VERSION_RULES, VERSIONS
from paged.kernels import step_version
from paged.kernels.features import BlockSparse
from paged.model.spec import ModelSpec
from paged.sim.decode_attention import AttentionShape, decode_bytes
from paged.sim.hardware import Hardware
from paged.sim.kernel_table import Entry, decode_table, shape_class
from paged.step import SchedulerOutput


@dataclass
class StepShape:
    """What the cost depends on: tokens computed, rows sampled, and each row's attention work."""

    num_tokens: int = 0
    num_sampled: int = 0
    num_seqs: int = 0
    # prefill rows (including recomputation and partly cached prompts): sum over rows of
    # (query, key) pairs, of query tokens and of context tokens
    prefill_pairs: int = 0
    prefill_queries: int = 0
    prefill_context: int = 0
    num_prefill_rows: int = 0
    # decode rows: one new token each, attending to `context` tokens
    decode_contexts: list[int] | None = None
    # blocks swapped between the device and the CPU pool before the step
    num_swap_blocks: int = 0
    block_size: int = 16
    # a prefix tier's copies (`paged.memory.kv_tiers`): evicted blocks written to host memory, and
    # blocks a prefix hit brings back from it
    num_offload_blocks: int = 0
    num_onload_blocks: int = 0
    # KV compression (`kv_press`): token slots whose K and V are copied within the pool before the step
    num_compact_slots: int = 0


@dataclass(frozen=True)
class StepCost:
    linear_s: float
    attention_s: float
    elementwise_s: float
    launch_bound_s: float  # time the layers wait on kernel launches beyond their own work
    communication_s: float
    head_s: float
    overhead_s: float
    decode_version: str | None
    swap_s: float = 0.0
    disk_s: float = 0.0  # waiting on the disk tier's reads (`paged.sim.tier_disk`)

    @property
    def total_s(self) -> float:
        return (
            self.linear_s + self.attention_s + self.elementwise_s + self.launch_bound_s + self.communication_s
            + self.head_s + self.overhead_s + self.swap_s + self.disk_s
        )


def _attended_pairs(num_positions: int, window: int | None) -> int:
    """(query, key) pairs of causal attention over positions 0..n-1, each query seeing at most
    `window` keys (itself included)."""
    if window is None or num_positions <= window:
        return num_positions * (num_positions + 1) // 2
    return window * (window + 1) // 2 + (num_positions - window) * window


def step_shape(sched: SchedulerOutput, block_size: int = 16, sliding_window: int | None = None) -> StepShape:
    """The cost-relevant shape of a scheduled step; a row with one new token is a decode row, as
    in the real executor. With a `sliding_window` each query attends to at most that many keys. A
    compressed sequence (`kv_press`) attends to the tokens it holds: its context less those evicted,
    in full-attention layers only (a press leaves a windowed KV group to its window)."""
    # summed in locals, the record built once: this runs every step of every simulated replica
    num_tokens = num_sampled = prefill_pairs = prefill_queries = prefill_context = num_prefill_rows = 0
    decode: list[int] = []
    offsets = sched.kv_offsets if sliding_window is None else None
    for i, item in enumerate(sched.scheduled):
        new = item.num_new_tokens
        context = item.seq.num_computed_tokens + new - (offsets[i] if offsets is not None else 0)
        num_tokens += new
        num_sampled += item.num_samples
        if new == 1:
            decode.append(context if sliding_window is None else min(context, sliding_window))
        else:
            num_prefill_rows += 1
            prefill_queries += new
            prefill_context += context if sliding_window is None else min(context, sliding_window + new - 1)
            # causal: each new token attends to the cached prefix and the new tokens up to itself
            prefill_pairs += _attended_pairs(context, sliding_window) - _attended_pairs(context - new, sliding_window)
    return StepShape(
        num_tokens, num_sampled, len(sched.scheduled), prefill_pairs, prefill_queries, prefill_context,
        num_prefill_rows, decode, len(sched.blocks_to_swap_out) + len(sched.blocks_to_swap_in), block_size,
        len(sched.blocks_to_offload), len(sched.blocks_to_onload),
        0 if sched.slots_to_compact is None else sched.slots_to_compact.shape[0],
    )


# kernels per layer: qkv, rotary, cache write, attention, o_proj, 2 norms, 2 residual adds,
# gate_up / fc1, activation, down / fc2
_KERNELS_PER_LAYER = 12


class CostModel:
    def __init__(
        self, spec: ModelSpec, hardware: Hardware, dtype_bytes: int, *, version: str = "auto",
        partition_size: int = 512, kv_dtype_bytes: int | None = None, blocksparse: BlockSparse | None = None,
        backend: str = "cuda",
    ) -> None:
        """`kv_dtype_bytes`: one KV cache element's bytes (None: `dtype_bytes`, the model's);
        `blocksparse`: the decode kernels read only the blocks its pattern keeps; `backend`: the
        kernel backend whose `kernel.version=auto` choice is priced (a simulated GPU runs cuda)."""
        allowed = (*VERSION_RULES, *VERSIONS)
        if version not in allowed:
            raise ValueError(f"kernel.version={version!r} is not supported; allowed: {', '.join(allowed)}")
        self.spec, self.hw, self.b = spec, hardware, dtype_bytes
        self.kv_b = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        self.version, self.partition_size, self.backend = version, partition_size, backend
        self.blocksparse = blocksparse
        # the KV tensors a compaction copy moves each token in: every layer's, or with KV groups the
        # `num_slots` of a block (the simulator sets it from its layout)
        self.kv_tensors = spec.num_layers
        g = hardware.num_gpus
        s = spec
        self.heads = s.num_heads // g
        # KV heads are split when they can be, else replicated (GQA with more GPUs than KV heads)
        self.kv_heads = max(1, s.num_kv_heads // g)
        self.q_size = self.heads * s.head_dim
        self.kv_size = self.kv_heads * s.head_dim
        inter = s.intermediate_size // g
        linear_params = s.layer_params - 2 * s.hidden_size * (2 if s.norm == "layernorm" else 1)
        self.linear_weights = linear_params / g
        self.flops = hardware.peak_flops(dtype_bytes)
        self.bw = hardware.memory_bandwidth * hardware.memory_efficiency
        h = s.hidden_size
        up_out = 2 * inter if s.mlp == "gated-silu" else inter
        # activation elements read and written by the linear layers, per token
        self.linear_act = h + (self.q_size + 2 * self.kv_size) + self.q_size + h + h + up_out + inter + h
        act = 3 * inter if s.mlp == "gated-silu" else 2 * inter
        rotary = 2 * (self.q_size + self.kv_size) if s.positions == "rope" else 0
        # elements per token at the model's dtype: 2 norms (read + write), 2 residual adds (2 reads
        # + write), the MLP activation and rotary
        self.elementwise = 2 * 2 * h + 2 * 3 * h + act + rotary
        # bytes per token of the KV-cache write: read K and V at the model's dtype, store them at the
        # cache's. fp8 adds no time: dividing by the scale happens in registers on the way through a
        # memory-bound kernel
        self.cache_write_bytes = 2 * self.kv_size * (self.b + self.kv_b)
        self.lm_head_weights = s.vocab_size * h / g
        # (output features, parameters) of each linear layer on one GPU, for wave quantization
        self.linears = [
            (self.q_size + 2 * self.kv_size, h * (self.q_size + 2 * self.kv_size)), (h, self.q_size * h),
            (up_out, h * up_out), (h, inter * h),
        ]
        self._efficiency: dict[int, float] = {}
        # the decode kernels' shape per cache block size (one in practice): built once, not every step
        self._attention_shapes: dict[int, AttentionShape] = {}
        # `decode_step`'s parts that depend on the batch size alone, per size
        self._decode_parts: dict[int, tuple[float, float, float, float, float]] = {}
        # a window step's parts per (block size, rows): `paged.sim.decode_steps`'
        self._decode_sizes: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.kernel_table: dict[tuple[str, str], Entry] = decode_table(hardware)

    def _matmul_efficiency(self, tokens: int) -> float:
        """The table's efficiency at `tokens`, times the share of the tensor cores' work that is
        useful when each GEMM's output is cut into tiles run in waves of `num_sms` (NVIDIA's tile
        and wave quantization). Tiles are `matmul_tile` wide in the output features; their height
        follows the batch (16 to `matmul_tile` tokens, as cuBLAS picks smaller tiles for small
        batches): a 128-token GEMM with 4096 outputs keeps 32 of an A100's 108 SMs busy."""
        tokens = max(tokens, 1)
        cached = self._efficiency.get(tokens)
        if cached is not None:
            return cached
        efficiency = self.hw.matmul_efficiency_at(tokens)
        tile, sms = self.hw.matmul_tile, self.hw.num_sms
        if tile:
            height = min(tile, max(16, 1 << (tokens - 1).bit_length()))
            issued = 0.0
            for features, params in self.linears:
                tiles = -(-tokens // height) * -(-features // tile)
                # parameters x the share of issued tile work that is useful
                issued += params * (-(-tiles // sms) * sms * height * tile) / (tokens * features)
            efficiency *= sum(p for _, p in self.linears) / issued
        self._efficiency[tokens] = efficiency
        return efficiency

    # -- per step ----------------------------------------------------------------------------------

    def step(self, shape: StepShape, layer_shapes: Sequence[tuple[StepShape, int]] = ()) -> StepCost:
        """The step's cost. `layer_shapes`: for layers of several attention windows, each window's
        shape of the same step (`step_shape` with that window) and its number of layers; the first
        one's decode kernel is the one reported. Empty: every layer attends as `shape`."""
        hw, L = self.hw, self.spec.num_layers
        t, n = shape.num_tokens, shape.num_sampled
        # a step that samples every token it computes (decodes): its batch size's parts, computed once
        linear, elementwise, communication, head = self.decode_parts(t)[:4] if t == n else self._dense(t, n)
        attention_s = launch_bound = 0.0
        version = None
        for part, num_layers in layer_shapes or ((shape, L),):
            attention, part_version = self._attention(part)
            version = version or part_version
            # v2's reduce is a kernel of its own; v3 merges its splits in the same pass
            kernels = _KERNELS_PER_LAYER + (part_version == "v2") + (
                part.num_prefill_rows > 0 and part_version is not None
            )
            layer = max(linear + attention + elementwise, kernels * hw.kernel_launch_s)
            attention_s += num_layers * attention
            launch_bound += num_layers * (layer - linear - attention - elementwise)
        overhead = hw.step_overhead_s + hw.seq_overhead_s * shape.num_seqs
        cost = StepCost(
            L * linear, attention_s, L * elementwise, launch_bound, communication, head, overhead, version,
            self._swap(shape) + self.compaction_s(shape),
        )
        return self._with_tier_copies(cost, shape) if shape.num_offload_blocks or shape.num_onload_blocks else cost

    def decode_step(self, contexts: list[int], block_size: int) -> StepCost:
        """`step`'s cost of a step of decode rows only (one per context, every layer alike, nothing
        swapped, copied or tiered), to the bit: the same operations in the same order (0.0 + x is x),
        with what depends on the batch size alone computed once per size (fast-forward's windows run
        thousands of steps of one size)."""
        attention, version = self._decode_attention(contexts, block_size)
        return self.decode_cost_of(len(contexts), attention, version)

    def decode_cost_of(self, n: int, attention: float, version: str) -> StepCost:
        """`decode_step`'s cost of `n` decode rows whose attention takes `attention` seconds a layer."""
        linear, elementwise, communication, head, overhead = self.decode_parts(n)
        L = self.spec.num_layers
        kernels = _KERNELS_PER_LAYER + (version == "v2")
        layer = max(linear + attention + elementwise, kernels * self.hw.kernel_launch_s)
        return StepCost(
            L * linear, L * attention, L * elementwise, L * (layer - linear - attention - elementwise),
            communication, head, overhead, version, 0.0,
        )

    def decode_parts(self, n: int) -> tuple[float, float, float, float, float]:
        """A step of `n` decode rows' layer linear and elementwise time, communication, embedding and
        LM head, and overhead: what depends on the batch size alone, computed once per size."""
        parts = self._decode_parts.get(n)
        if parts is None:
            hw = self.hw
            parts = (*self._dense(n, n), hw.step_overhead_s + hw.seq_overhead_s * n)
            self._decode_parts[n] = parts
        return parts

    def _dense(self, t: int, n: int) -> tuple[float, float, float, float]:
        """A layer's linear and elementwise time, the step's communication and its embedding and
        LM head, for `t` tokens computed and `n` rows sampled."""
        hw, b, s, L = self.hw, self.b, self.spec, self.spec.num_layers
        linear = max(
            2 * t * self.linear_weights / (self.flops * self._matmul_efficiency(t)),
            (self.linear_weights + t * self.linear_act) * b / self.bw,
        )
        elementwise = t * (self.elementwise * b + self.cache_write_bytes) / self.bw
        communication = 0.0
        if hw.num_gpus > 1:
            ring = 2 * (hw.num_gpus - 1) / hw.num_gpus
            communication = 2 * L * (hw.allreduce_latency_s + ring * t * s.hidden_size * b / hw.interconnect_bandwidth)
        head = t * s.hidden_size * b / self.bw  # embedding gather
        if n:
            head += max(
                2 * n * self.lm_head_weights / (self.flops * self._matmul_efficiency(n)),
                (self.lm_head_weights * b + n * s.vocab_size * 4) / self.bw,
            )
            head += 2 * n * s.vocab_size * 4 / self.bw  # softmax / argmax over fp32 logits
        return linear, elementwise, communication, head

    def _with_tier_copies(self, cost: StepCost, shape: StepShape) -> StepCost:
        """A prefix tier's copies, priced as tiered KV caches move them (LMCache, vLLM's offloading
        connector): per direction one batched gather of every block and layer, not vLLM V0's copy per
        block per layer that `_swap` prices. Blocks brought back are waited for before the step
        computes; blocks written out run on the copy engine while it computes and add only what
        outlasts the step."""
        hw = self.hw
        block_bytes = 2 * self.spec.num_layers * shape.block_size * self.kv_size * self.kv_b
        rate = hw.pcie_bandwidth * hw.memory_efficiency

        def transfer(num_blocks: int) -> float:
            return hw.pcie_latency_s + num_blocks * block_bytes / rate if num_blocks else 0.0

        onload = transfer(shape.num_onload_blocks)
        offload = max(0.0, transfer(shape.num_offload_blocks) - cost.total_s)
        return dataclasses.replace(cost, swap_s=cost.swap_s + onload + offload)

    def _swap(self, shape: StepShape) -> float:
        """vLLM's swap_blocks: one PCIe copy per block, per layer, for K and for V, on each GPU in
        parallel; each pays a fixed latency, so small blocks waste the link (the paper's Fig. 19)."""
        if not shape.num_swap_blocks:
            return 0.0
        hw = self.hw
        copies = 2 * self.spec.num_layers * shape.num_swap_blocks
        copy_bytes = shape.block_size * self.kv_size * self.kv_b
        return copies * (hw.pcie_latency_s + copy_bytes / (hw.pcie_bandwidth * hw.memory_efficiency))

    def compaction_s(self, shape: StepShape) -> float:
        """KV compression's slot copies (`paged.kernels.copy_slots`, kernels_cu/cache.cuh's
        move_slots_kernel): per KV tensor (`kv_tensors`) a gather launch into a buffer and a scatter
        launch out of it, each reading and writing every moved token's K and V in device memory."""
        if not shape.num_compact_slots:
            return 0.0
        # K and V; gather and scatter; read and written
        moved = 2 * 2 * 2 * self.kv_tensors * shape.num_compact_slots * self.kv_size * self.kv_b
        return 2 * self.kv_tensors * self.hw.kernel_launch_s + moved / self.bw

    def _read(self, context: int) -> float:
        """Context tokens one decode row's kernel reads: all of them, or with block-sparse attention
        the query's `local_blocks` last sparse blocks plus one in `vert_stride` of the others (the
        vertical ones shift with the head, so across heads a row reads that share on average).
        Prefill stays priced dense: the prefill paths mask the pattern rather than skip it."""
        sparse = self.blocksparse
        if sparse is None:
            return context
        num_sparse = -(-context // sparse.block_size)
        remote = max(0, num_sparse - sparse.local_blocks)
        local = context - remote * sparse.block_size
        return local + remote * sparse.block_size / sparse.vert_stride

    def _attention(self, shape: StepShape) -> tuple[float, str | None]:
        """Queries and outputs move at the model's dtype, K/V at the cache's, as the attention
        kernels read every context token from the cache. An fp8 cache adds no dequantisation time:
        decode attention is priced by its bytes alone (the conversion to fp32 happens in registers as
        the K/V stream in), and prefill's flops run on the dequantised fp16 tiles."""
        hw, b, kv_b, d = self.hw, self.b, self.kv_b, self.spec.head_dim
        time = 0.0
        if shape.num_prefill_rows:
            flops = 4 * d * self.heads * shape.prefill_pairs
            traffic = 2 * shape.prefill_queries * self.q_size * b + 2 * shape.prefill_context * self.kv_size * kv_b
            time += max(flops / (self.flops * hw.prefill_attention_efficiency), traffic / self.bw)
        contexts = shape.decode_contexts
        if not contexts:
            return time, None
        attention, version = self._decode_attention(contexts, shape.block_size)
        return time + attention, version

    def attention_shape(self, block_size: int) -> AttentionShape:
        """The decode kernels' shape at `block_size`, built once."""
        attention = self._attention_shapes.get(block_size)
        if attention is None:
            attention = AttentionShape(self.heads, self.kv_heads, self.spec.head_dim, self.b, self.kv_b, block_size,
                                       self.partition_size)
            self._attention_shapes[block_size] = attention
        return attention

    def _decode_attention(self, contexts: list[int], block_size: int) -> tuple[float, str]:
        """The decode rows' attention time and kernel version."""
        hw = self.hw
        num, longest = len(contexts), max(contexts)
        version = step_version(self.version, longest, num, self.heads, self.partition_size, backend=self.backend)
        attention = self.attention_shape(block_size)
        # dense attention reads every context token (`_read` is the identity then)
        read = sum(contexts) if self.blocksparse is None else sum(map(self._read, contexts))
        work = decode_bytes(version, contexts, read, attention, hw.num_sms)
        efficiency = self.kernel_table[version, shape_class(num, longest)].efficiency
        return work / (hw.memory_bandwidth * efficiency), version
