"""One engine step's record (`StepRecord`): what the metrics keep or stream per step."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


# slots: a long simulated fleet run keeps millions of these
@dataclass(slots=True)
class StepRecord:
    engine_step: int
    time_s: float
    is_prefill: bool  # some row computes a prompt (with chunked prefill, decode rows may run beside it)
    batch_size: int
    num_decode_rows: int
    num_scheduled_tokens: int
    num_computed_tokens: int
    num_sampled_tokens: int  # tokens generated: one per decode row, the first ones of each prompt completed
    step_time_s: float
    overhead_s: float
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_usage: float
    token_state_fraction: float
    # the four-way breakdown of the whole KV pool (stats.KVStats.breakdown); with kv_free_fraction they sum to 1
    kv_token_state_fraction: float
    kv_reserved_fraction: float
    kv_internal_frag_fraction: float
    kv_external_frag_fraction: float
    kv_free_fraction: float
    # blocks saved by sharing / blocks without sharing (stats.KVStats.sharing_saving)
    kv_sharing_saving: float
    num_logical_blocks: int
    num_swapped: int
    num_swap_blocks: int  # blocks moved to or from the CPU pool before this step
    num_allocated_blocks: int
    num_cached_free_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    attention_version: str | None  # decode kernel that ran (v1/v2/v3); None in a step without decode rows
    kv_tokens_held: int = 0  # tokens whose KV the sequences hold, each once (stats.KVStats.tokens_held)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
