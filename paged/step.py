"""The per-step contract: plain records that the scheduler, the executors and the metrics pass
each other (vLLM V1's `sched/output.py`, `outputs.py` and `metrics/stats.py`).

One engine step: the scheduler hands the executor a `SchedulerOutput` (which sequences, how many
tokens each, block tables, blocks to copy or swap); the executor returns an `ExecutorOutput` (the
sampled tokens as `Samples` per row, and where the step's time went); the scheduler applies it and
reports `SchedulerStats`, with the KV cache's occupancy as `KVStats`. Nothing here imports torch, so
every layer above can import it.

`KVStats`: A snapshot of KV cache occupancy, taken every engine step, and its four-way breakdown.

The PagedAttention paper (Fig. 2) splits KV memory into token states, reservation (slots held for
tokens a request will still produce), internal fragmentation (slots held that it will never use)
and external fragmentation (memory no request can be given). Every slot of the pool is in exactly
one of those or free, so the five shares sum to 1. Sharing is measured apart: how many blocks the
sequences' tables name versus how many distinct blocks they hold.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from paged.request import Request, SamplingParams, Sequence

_NUM_NEW_TOKENS = operator.attrgetter("num_new_tokens")  # summed over every row of every step

# token id -> (log-probability, rank in the distribution, 1 = most likely)
TokenLogprobs = dict[int, tuple[float, int]]


def scores_tokens(params: SamplingParams) -> bool:
    """Whether a request's sampled tokens carry their log-probabilities: it asks for them, or its
    sequence group ranks by them (beam search; best_of > n keeps the n samples of highest cumulative
    log-probability). The others' tokens carry 0.0 and their outputs report cumulative_logprob None,
    as vLLM V1's do: the sampler computes nothing for them."""
    return params.logprobs is not None or params.use_beam_search or (params.best_of or params.n) > params.n


def tokens_can_lag(params: SamplingParams) -> bool:
    """Whether a request's sampled tokens may reach the host one step late (async scheduling,
    `paged.scheduler.lagged_update`): its one sequence (best_of 1: no forks, no beams) samples without
    reading its earlier tokens on the host (no penalties), and it asks for tokens only (no logprobs,
    no prompt_logprobs, which the sampler reads in the step). A step holding any other request runs
    synchronously, applied before the next one is scheduled."""
    return (
        params.best_of == 1 and not scores_tokens(params) and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
    )


@dataclass
class Samples:
    """What one row produced: its tokens, each one's log-probability (0.0 unless `scores_tokens`),
    and per token its own and the top `params.logprobs` log-probabilities when the request asks for
    them."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class ScheduledSeq:
    """Compute `seq.token_ids[num_computed : num_computed + num_new_tokens]` this step.

    `num_computed` is `seq.num_computed_tokens` before the step: the KV of those tokens is
    already in the cache (earlier steps or prefix-cache hits). `num_samples` tokens are sampled
    from the last position, as the request's sequence group decides: 0 while a prompt is only
    partly computed, `n` when a request with n > 1 samples its first tokens (the group then forks
    the other n - 1 sequences), else 1.
    """

    seq: Sequence
    num_new_tokens: int
    block_table: list[int]
    num_samples: int = 1
    # With KV groups per layer type (`paged.kv_layout`), every group's table in group order (the
    # first is `block_table`); None with one group.
    group_tables: list[list[int]] | None = None

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def context_len(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token extends the sequence; any other row computes (part of) a prompt, or
        recomputes a preempted sequence. Only meaningful before the step is applied."""
        seq = self.seq
        return self.num_new_tokens == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens + 1 == seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # whether any row computes a prompt (chunked prefill mixes them with decode rows in one step)
    is_prefill: bool = False
    num_decode_rows: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (device block, CPU block) pairs to move out before the step, (CPU block, device block) in;
    # a step never does both (swap-ins are only scheduled when nothing was preempted)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # tiers for evicted prefixes (`paged.memory.kv_tiers`): (device block, host block) copies of cached
    # blocks the device evicted, (host block, device block) copies of prefix hits found in a tier;
    # offloads run first (with the swap-outs), onloads last (with the swap-ins), before any KV is written
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_onload: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)
    # KV compression (`kv_press`; all three unset without a press): int64 [n, 2] (src, dst) token slots
    # to copy after the swap-outs and tier offloads, before anything else writes a block (the kept
    # tokens of sequences compacted last step); per scheduled row, the tokens evicted before its KV in
    # each compressed KV group (`KVLayout.full_groups`; None: none anywhere, so each row's KV index is
    # its position; a windowed group's always is); the rows whose sequences the press
    # judges after this step, whose KV norms the executor returns when `press_norms`
    slots_to_compact: np.ndarray | None = None
    kv_offsets: list[int] | None = None
    press_rows: list[int] = field(default_factory=list)
    press_norms: bool = False
    # the rows whose attention mass a scoring press reads (`paged.executor.attention_scores`), from each
    # row's last `score_queries` queries (None: all of the step's)
    score_rows: list[int] = field(default_factory=list)
    score_queries: int | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(map(_NUM_NEW_TOKENS, self.scheduled))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled



@dataclass
class ExecutorOutput:
    """Sampled token ids per scheduled sequence, in `SchedulerOutput.scheduled` order (empty for a
    sequence whose prompt is only partly computed), and where the step's time went."""

    sampled: list[list[int]]
    num_computed_tokens: int = 0
    model_time_s: float = 0.0  # forward pass, attention and sampling
    prep_time_s: float = 0.0  # building the step's input tensors: engine overhead, not model time
    attention_version: str | None = None  # the decode kernel that ran (v1/v2/v3); None without decode rows
    # per scheduled sequence, each sampled token's log-probability (None: an executor without them, 0.0)
    logprobs: list[list[float]] | None = None
    # per scheduled sequence, per sampled token its own and the top-k log-probabilities, when asked
    top_logprobs: list[list[TokenLogprobs] | None] | None = None
    # seq_id -> per prompt token (None for the first) for requests asking for prompt_logprobs
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)
    # seq_id -> float32 `[compressed KV groups, held]` L2 norms of its held keys and values, averaged over
    # each group's layers and the KV heads, for the sequences of `SchedulerOutput.press_rows` when it asks
    # for `press_norms`
    kv_norms: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # seq_id -> float32 `[compressed KV groups, held]` attention mass on each held token (summed over KV
    # heads, averaged over each group's layers), for the sequences of `SchedulerOutput.score_rows`
    attention_scores: dict[int, np.ndarray] = field(default_factory=dict)
    compaction_time_s: float = 0.0  # copying `slots_to_compact`

    def samples(self, i: int) -> Samples:
        """What the i-th scheduled sequence sampled."""
        tokens = self.sampled[i]
        logprobs = self.logprobs[i] if self.logprobs is not None else [0.0] * len(tokens)
        return Samples(tokens, logprobs, self.top_logprobs[i] if self.top_logprobs is not None else None)



@dataclass(frozen=True)
class KVStats:
    num_total_blocks: int
    num_allocated_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_token_slots_used: int
    block_size: int
    # cumulative since the manager was built: prompt tokens looked up in / found in the prefix cache
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    # empty slots of assigned blocks that their sequence will fill before it reaches its length limit
    num_reserved_slots: int = 0
    # allocated blocks that no sequence holds (a buddy allocator's rounding up to a power of two)
    num_unassigned_blocks: int = 0
    # free blocks in pieces too small for the request that waits for memory
    num_stranded_free_blocks: int = 0
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    # block-table entries over all sequences: the blocks they would hold if nothing were shared
    num_logical_blocks: int = 0
    # tiers for evicted prefixes, cumulative: prompt tokens served by the CPU / disk tier (they are in
    # num_hit_tokens too), blocks copied device -> CPU and back, written to and read from disk, and
    # disk blocks found missing or corrupt (misses)
    num_hit_tokens_cpu: int = 0
    num_hit_tokens_disk: int = 0
    num_offload_blocks: int = 0
    num_onload_blocks: int = 0
    num_disk_write_blocks: int = 0
    num_disk_read_blocks: int = 0
    num_disk_bad_blocks: int = 0
    # cached blocks the prefix cache evicted so far (cumulative; 0 without a prefix cache)
    num_evictions: int = 0
    # tokens whose KV the sequences hold, each counted once (with KV groups a token fills a slot in
    # every group that keeps it); None: `num_token_slots_used`, as with one group
    num_tokens_held: int | None = None

    @property
    def tokens_held(self) -> int:
        return self.num_token_slots_used if self.num_tokens_held is None else self.num_tokens_held

    @property
    def sharing_saving(self) -> float:
        """The paper's memory saving (Fig. 14, 15): blocks saved by sharing (between a request's
        samples or beams, and prefix-cache hits) / blocks the same sequences would hold without."""
        if self.num_logical_blocks == 0:
            return 0.0
        held = self.num_allocated_blocks - self.num_unassigned_blocks
        return 1.0 - held / self.num_logical_blocks

    @property
    def kv_usage(self) -> float:
        """Allocated blocks / total: the memory the KV cache holds."""
        return self.num_allocated_blocks / self.num_total_blocks

    @property
    def token_state_fraction(self) -> float:
        """Slots holding token states / allocated slots: 1 minus internal fragmentation."""
        if self.num_allocated_blocks == 0:
            return 1.0
        return self.num_token_slots_used / (self.num_allocated_blocks * self.block_size)

    @property
    def num_total_slots(self) -> int:
        return self.num_total_blocks * self.block_size

    @property
    def num_internal_frag_slots(self) -> int:
        """Slots of assigned blocks that hold no token state and never will."""
        assigned = (self.num_allocated_blocks - self.num_unassigned_blocks) * self.block_size
        return assigned - self.num_token_slots_used - self.num_reserved_slots

    @property
    def num_external_frag_slots(self) -> int:
        return (self.num_unassigned_blocks + self.num_stranded_free_blocks) * self.block_size

    def breakdown(self) -> dict[str, float]:
        """Shares of the whole pool: token states, reserved, internal, external fragmentation, free."""
        total = self.num_total_slots
        token = self.num_token_slots_used / total
        reserved = self.num_reserved_slots / total
        internal = self.num_internal_frag_slots / total
        external = self.num_external_frag_slots / total
        free = (self.num_free_blocks - self.num_stranded_free_blocks) * self.block_size / total
        return {"token_state": token, "reserved": reserved, "internal_frag": internal,
                "external_frag": external, "free": free}


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues and the cache's occupancy after a step."""

    num_running: int
    num_waiting: int
    kv: KVStats
    num_swapped: int = 0
