"""`executor=sim`: the unchanged engine driven by a cost model on a virtual clock.

Each step advances the clock by the cost model's time for exactly the work the scheduler handed
over (tokens, contexts, rows that sample) and returns placeholder tokens, so the scheduler, block
manager, allocators and policies run as they would on the real model. Requests end at their
`max_tokens` (there is no EOS to sample). A placeholder token is a fixed function of the sequence's
last token and length (and, when sampling, of the sample index), so identical greedy contexts
produce identical continuations and prefix-cache hashes behave as on a real greedy model.

Beam search runs the real `BeamSearch` group on placeholder log-probabilities, so its forks, prunes
and copy-on-write are the engine's own. The length model: with no EOS, every beam (and every
parallel sample) runs to the request's `max_tokens` (its sampled output length). Which beams
survive follows from the candidates' log-probabilities: per beam and step, the top candidate's
probability q is uniform in [BEAM_TOP_PROB_MIN, 1) (hashed from the context) and the j-th next one
has (1 - q) j^-s / zeta(s), a power-law tail with s = BEAM_TAIL_EXPONENT. A confident step lets the
best beam take every slot, so beams coalesce onto a shared history as real beams do; the heavy tail
lets a wider beam keep more parents alive. s = 1.3 was picked from {1.0, 1.3, 1.5} against the
paper's Alpaca beam savings (a geometric tail, tried first, let width 6 coalesce 8 points too much).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import cached_property

import torch
from omegaconf import OmegaConf

from paged.config import ConfigError, HardwareConfig, KernelConfig, ModelConfig, resolve_dtype
from paged.executor.base import Executor, KVCacheSpec, Tokenizer
from paged.kernels.features import BlockSparse, cache_dtype
from paged.kv_layout import KVLayout
from paged.model.spec import model_spec
from paged.sim.cost_model import CostModel, StepCost, step_shape
from paged.sim.decode_steps import StepSums, StepTotals, step_costs
from paged.sim.hardware import Hardware, resolve_hardware
from paged.sim.memory import check_parallelism, plan_memory
from paged.sim.tier_disk import SimTierDisk
from paged.step import ExecutorOutput, SchedulerOutput
from paged.utils.clock import Clock, VirtualClock

log = logging.getLogger(__name__)

# the placeholder candidate distribution of beam rows (module docstring)
BEAM_TOP_PROB_MIN = 0.5
BEAM_TAIL_EXPONENT = 1.3
_MASK = (1 << 64) - 1
# log zeta(s), s = BEAM_TAIL_EXPONENT, normalises the tail j^-s over j >= 1 (terms past 1000 as an integral)
_TAIL_LOG_NORM = math.log(
    sum(j**-BEAM_TAIL_EXPONENT for j in range(1, 1000)) + 1000 ** (1 - BEAM_TAIL_EXPONENT) / (BEAM_TAIL_EXPONENT - 1)
)


def _candidate_logprob(q: float, rank: int) -> float:
    """The placeholder log-probability of the `rank`-th most likely token (module docstring)."""
    if rank == 0:
        return math.log(q)
    return math.log1p(-q) - BEAM_TAIL_EXPONENT * math.log(rank) - _TAIL_LOG_NORM


def _unit(*keys: int) -> float:
    """A uniform number in [0, 1) hashed from integers (splitmix64 finalizer): no generator state."""
    x = 0x9E3779B97F4A7C15
    for k in keys:
        x = ((x ^ (k & _MASK)) * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 31
    return (x >> 11) / float(1 << 53)

# a placeholder token's hash: last * TOKEN_MUL + length * LENGTH_MUL, plus SAMPLE_MUL per sample index
TOKEN_MUL, LENGTH_MUL, SAMPLE_MUL = 1103515245, 12345, 7919


def plain_token(last: int, length: int, vocab: int, greedy: bool, index: int) -> int:
    """The placeholder token of a plain request's row (one sample, no beams), after `last` at `length`."""
    base = last * TOKEN_MUL + length * LENGTH_MUL
    return base % vocab if greedy else (base + SAMPLE_MUL * (index + 1)) % vocab


class SimExecutor(Executor):
    """Public state besides the `Executor` contract: `spec`, `hardware`, `cost_model`, `dtype_name` and
    `dtype_bytes` (weights and activations), `kv_cache_dtype` and `kv_dtype_bytes` (the KV cache's element, from
    `kernel.kv_cache_dtype`), and the `last_cost` breakdown of the latest step."""

    runs_spec_models = True
    supports_swap = True
    # KV compression (`kv_press`): the block manager frees what a press evicts; the cost model prices the
    # compaction copies and the shorter reads (it has no K/V: presses that read norms or scores cannot run)
    supports_kv_press = True
    supports_kv_tiers = True
    # the paper's block-size sweeps (Fig. 18, 19) go from 1 to 256 tokens
    block_sizes = tuple(1 << i for i in range(9))

    def __init__(self, model: ModelConfig, kernel: KernelConfig, hardware: HardwareConfig, seed: int = 0) -> None:
        hw_cfg = OmegaConf.merge(OmegaConf.structured(HardwareConfig), hardware)
        self.model_cfg = model
        self.spec, tokenizer_source = model_spec(model)
        check_parallelism(self.spec, hw_cfg.num_gpus)
        # model.dtype=auto and kernel.backend=auto mean what the real model would run on the simulated
        # device: a calibrated hardware is this machine's CPU (cpu-local), every other one a GPU
        self._device = "cpu" if hw_cfg.calibrated else "cuda"
        self.dtype_name = resolve_dtype(model.dtype, self._device)
        self.dtype_bytes = getattr(torch, self.dtype_name).itemsize
        # a calibrated hardware (cpu-local) arrives measured from the builder (paged.sim.calibrate)
        self.hardware: Hardware = resolve_hardware(hw_cfg)
        self._tokenizer_source = tokenizer_source
        self.seed = seed
        self.num_devices = self.hardware.num_gpus
        self.layer_windows = self.spec.layer_windows
        windows = set(self.layer_windows)
        self.sliding_window = windows.pop() if len(windows) == 1 else None
        # (window, layers with it) per attention type, widest first (its decode kernel is the one
        # reported); one type: the plain path, costed for one window
        counts = {w: self.layer_windows.count(w) for w in self.layer_windows}
        self._window_layers = sorted(counts.items(), key=lambda wn: float("inf") if wn[0] is None else wn[0],
                                     reverse=True) if len(counts) > 1 else []
        self.block_size = 16
        self.configure_kernel(kernel)
        self._last_cost: StepCost | None = None
        # a window call's steps whose last is `last_cost` until it is read: (steps, how many ran, contexts)
        self._last_steps: tuple[StepTotals, int, list[int]] | None = None
        self._floors: dict[int, float] = {}  # `decode_floor` per batch size
        self.tier_disk: SimTierDisk | None = None

    def host_memory_bytes(self) -> None:
        """The swap pool is bookkeeping here: no host memory to fit it in."""
        return None

    @cached_property
    def tokenizer(self) -> Tokenizer | None:  # type: ignore[override]
        """The model's own tokenizer when it has one, so a workload gives the real run's token ids."""
        if self._tokenizer_source is None:
            return None
        from paged.model.tokenizer import load_tokenizer

        return load_tokenizer(self._tokenizer_source, chat_template=self.model_cfg.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def description(self) -> str:
        return (
            f"{self.spec.name} ({self.dtype_name}) simulated on {self.hardware.num_gpus} x {self.hardware.name}, "
            f"KV cache {self.kv_cache_label}"
        )

    @property
    def kv_cache_label(self) -> str:
        """The cache's element type and size, e.g. "fp8_e4m3 (1 B/elem)"."""
        return f"{self.kv_cache_dtype} ({self.kv_dtype_bytes} B/elem)"

    def configure_kernel(self, kernel: KernelConfig) -> None:
        """The kernel settings, the KV cache's dtype among them: a reused executor's blocks take
        the new engine's element size."""
        model_dtype = getattr(torch, self.dtype_name)
        self.kv_cache_dtype = self.dtype_name if kernel.kv_cache_dtype == "auto" else kernel.kv_cache_dtype
        self.kv_dtype_bytes = cache_dtype(kernel.kv_cache_dtype, model_dtype).itemsize
        sparse = BlockSparse.from_config(dict(kernel.blocksparse)) if kernel.blocksparse else None
        self.cost_model = CostModel(
            self.spec, self.hardware, self.dtype_bytes, version=kernel.version, partition_size=kernel.partition_size,
            kv_dtype_bytes=self.kv_dtype_bytes, blocksparse=sparse,
            backend=self._device if kernel.backend == "auto" else kernel.backend,
        )
        pattern = f", block-sparse {sparse}" if sparse else ""
        self.kernel_description = f"{kernel.version} (simulated paged attention{pattern})"

    @cached_property
    def clock(self) -> Clock:
        return VirtualClock()

    def set_kv_layout(self, layout: KVLayout) -> None:
        super().set_kv_layout(layout)
        self.cost_model.kv_tensors = layout.num_slots  # what a compaction copy moves: one block's layers

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        """A block across all GPUs: with more GPUs than KV heads each GPU keeps a replica of one. A
        block holds the layers of one KV group (`kv_layout.num_slots`), every layer without a layout."""
        gpus, kv_heads = self.hardware.num_gpus, self.cost_model.kv_heads
        layers = self.spec.num_layers if self.kv_layout is None else self.kv_layout.num_slots
        per_token = 2 * layers * kv_heads * gpus * self.spec.head_dim * self.kv_dtype_bytes
        return KVCacheSpec(
            block_size,
            per_token * block_size,
            f"simulated: {layers} layers x K/V x {kv_heads} heads x {self.spec.head_dim} x "
            f"{self.kv_cache_label} on each of {gpus} GPU(s)",
        )

    def kv_cache_budget(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        plan = plan_memory(
            self.spec, self.hardware, self.dtype_bytes, utilization=utilization,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        )
        log.info("memory: %s", plan.describe(self.hardware, utilization, self.kv_cache_label))
        return plan.kv_cache_bytes

    def kv_tier_store(self, directory: str) -> SimTierDisk:
        """The disk tier's time at `hardware.disk_bandwidth`; no files (`directory` is not used)."""
        if self.hardware.disk_bandwidth is None:
            raise ConfigError(f"allocator.offload.disk_path needs hardware.disk_bandwidth; hardware="
                              f"{self.hardware.name} leaves it unset")
        self.tier_disk = SimTierDisk(self.kv_cache_spec(self.block_size).bytes_per_block, self.hardware.disk_bandwidth)
        return self.tier_disk

    def init_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """Nothing to allocate: the blocks exist only in the block manager's accounting."""
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.tier_disk = None  # a new engine's cache: its own disk tier, if any, is made after

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        if self._window_layers:  # layers of several windows: each window's attention costed apart
            parts = [(step_shape(sched, self.block_size, w), n) for w, n in self._window_layers]
            shape = parts[0][0]
            cost = self.cost_model.step(shape, parts)
        else:
            shape = step_shape(sched, self.block_size, self.sliding_window)
            cost = self.cost_model.step(shape)
        if self.tier_disk is not None:  # a disk tier's reads hold the step up
            cost = dataclasses.replace(cost, disk_s=self.tier_disk.stall_s(cost.total_s))
        self.last_cost = cost
        self.clock.advance(cost.total_s)  # type: ignore[attr-defined]
        sampled, logprobs = self._placeholders(sched)
        return ExecutorOutput(
            sampled, shape.num_tokens, model_time_s=cost.total_s - cost.overhead_s,
            attention_version=cost.decode_version, logprobs=logprobs,
            compaction_time_s=self.cost_model.compaction_s(shape) if shape.num_compact_slots else 0.0,
        )

    def decode_cost(self, contexts: list[int]) -> StepCost | None:
        """The cost of a step of decode rows only, attending to `contexts` tokens, with nothing to
        swap or copy: `execute`'s cost of that step, to the bit (fast-forward). None where the step's
        cost depends on more than its rows (layers of several windows, a disk tier's reads)."""
        if self._window_layers or self.tier_disk is not None:
            return None
        window = self.sliding_window
        decode = contexts if window is None else [min(c, window) for c in contexts]
        return self.cost_model.decode_step(decode, self.block_size)

    def step_costs(self, sums: StepSums, offset: int, cap: int, start: float, until: float) -> StepTotals | None:
        """`decode_cost` of `sums.base + offset + j` for j = 0, 1, ... (a window's steps, its sums
        carried from call to call): the first step and those that start before `until` on a clock at
        `start`, at most `cap`; None where `decode_cost` is."""
        if self._window_layers or self.tier_disk is not None:
            return None
        window = self.sliding_window
        if window is None:
            return step_costs(self.cost_model, sums, offset, self.block_size, cap, start, until)
        out = StepTotals([], [], [])
        t = start
        for j in range(cap):
            if j and t >= until:
                break
            contexts = [min(c + offset + j, window) for c in sums.base]
            cost = self.cost_model.decode_step(contexts, self.block_size)
            t += cost.total_s
            out.ends.append(t)
            out.model_times.append(cost.total_s - cost.overhead_s)
            out.versions.append(cost.decode_version)
            out.last = cost
        return out

    def decode_floor(self, num_rows: int) -> float | None:
        """A lower bound of `decode_cost(contexts).total_s` for any `num_rows` contexts (a lagging
        replica's horizon): the step without its attention, with the fewest kernels a layer; shaved
        by a millionth so that no rounding of the summed costs can cross it. None where
        `decode_cost` is."""
        if self._window_layers or self.tier_disk is not None:
            return None
        floor = self._floors.get(num_rows)
        if floor is None:
            floor = self._floors[num_rows] = self.cost_model.decode_cost_of(num_rows, 0.0, "v1").total_s * (1.0 - 1e-6)
        return floor

    def advance_steps(self, contexts: list[int], steps: StepTotals, k: int) -> None:
        """Account the first `k` of a window call's steps (`step_costs`' from `contexts`), run
        without `execute` (fast-forward): the clock at the k-th's end, which the same additions from
        the clock's time gave, and `last_cost` (built when read)."""
        assert steps.ends[0] >= self.clock.now()
        self.clock.wait_until(steps.ends[k - 1])  # type: ignore[attr-defined]
        self._last_cost = None
        self._last_steps = (steps, k, contexts)

    @property
    def last_cost(self) -> StepCost | None:
        """The latest step's cost breakdown."""
        if self._last_steps is not None:
            steps, k, contexts = self._last_steps
            self._last_steps = None
            self._last_cost = (steps.last_cost(self.cost_model) if k == len(steps.ends)
                               else self.decode_cost([c + k - 1 for c in contexts]))
        return self._last_cost

    @last_cost.setter
    def last_cost(self, cost: StepCost | None) -> None:
        self._last_cost = cost
        self._last_steps = None

    def _placeholders(self, sched: SchedulerOutput) -> tuple[list[list[int]], list[list[float]]]:
        """Tokens and their log-probabilities per scheduled sequence (module docstring)."""
        vocab = self.spec.vocab_size
        sampled: list[list[int]] = []
        logprobs: list[list[float]] = []
        for item in sched.scheduled:
            n = item.num_samples
            if not n:
                sampled.append([])
                logprobs.append([])
                continue
            seq = item.seq
            token_ids = seq.token_ids
            last, length = token_ids[-1], len(token_ids)
            base = last * TOKEN_MUL + length * LENGTH_MUL
            params = seq.request.params
            if n == 1 and params.best_of == 1 and not params.use_beam_search:
                # a plain request's row, nearly every row: the general case below with n = 1
                sampled.append([plain_token(last, length, vocab, params.greedy, seq.index)])
                logprobs.append([0.0])
                continue
            if params.use_beam_search or params.greedy:
                # distinct candidates, most likely first (a greedy row repeats its first)
                tokens = ([(base + SAMPLE_MUL * j) % vocab for j in range(n)] if params.use_beam_search
                          else [base % vocab] * n)
            else:  # samples differ between a request's sequences, as sampling would make them
                tokens = [(base + SAMPLE_MUL * (seq.index + i + 1)) % vocab for i in range(n)]
            sampled.append(tokens)
            if params.best_of == 1:  # nothing ranks a lone sample by its log-probability
                logprobs.append([0.0])
                continue
            q = BEAM_TOP_PROB_MIN + (1 - BEAM_TOP_PROB_MIN) * _unit(last, length, seq.index)
            ranks = range(n) if params.use_beam_search else [0] * n
            logprobs.append([_candidate_logprob(q, j) for j in ranks])
        return sampled, logprobs
