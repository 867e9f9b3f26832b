"""Longest prefix match (SGLang's `lpm` schedule policy): admit first the waiting sequence with the
most prompt tokens already in the prefix cache.

Why: a cached prefix is prefill work that need not be done, and admitting the sequences that share
what is cached now uses those blocks before eviction takes them (Zheng et al. 2024, "SGLang:
Efficient Execution of Structured Language Model Programs", section 3, cache-aware scheduling; in
SGLang it is `CacheAwarePolicy.LPM` of sglang/srt/managers/schedule_policy.py). Ties go by arrival.

Each look-up walks a sequence's block hashes against the cache (the block manager keeps the hash
chains, so only the look-ups are repeated), once per waiting sequence per step. Like SGLang, the
policy falls back to FCFS when more than `fcfs_above` sequences wait (SGLang: 128), where matching
and sorting the whole queue every step gets expensive. Only waiting sequences are matched: a running
or swapped sequence's own blocks are (or just were) in the cache, so matching them would measure its
length, not reuse; they are served first come, first served. The newest running sequence is
preempted, as in FCFS.
"""

from __future__ import annotations

from paged.request import SeqStatus, Sequence
from paged.scheduler.policy import SchedulingPolicy


class LPMPolicy(SchedulingPolicy):
    step_invariant = True
    def __init__(self, fcfs_above: int = 128) -> None:
        if isinstance(fcfs_above, bool) or not isinstance(fcfs_above, int) or fcfs_above < 0:
            raise ValueError(f"fcfs_above must be an integer >= 0 (waiting sequences), got {fcfs_above!r}")
        self.fcfs_above = fcfs_above

    def admission_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        cached = 0
        if self.block_manager is not None and seq.status is SeqStatus.WAITING:
            cached = self.block_manager.num_cached_tokens(seq)
        return (-cached, seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[float, int]:
        return (seq.request.arrival_time, seq.seq_id)

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        if len(seqs) > self.fcfs_above:
            return sorted(seqs, key=lambda s: (s.request.arrival_time, s.seq_id))
        return super().order(seqs, now)
