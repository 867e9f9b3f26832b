"""What one step holds, and the units the scheduler fills it with.

A step has a token budget (`max_num_batched_tokens`) and `max_num_seqs` seats. A request's
sequences (samples, beams) take their seats together as one gang, and a request not yet forked
holds the seats its samples or beams will fill. With `chunked_prefill` a prompt runs in chunks of
what token budget is left, capped by `long_prefill_token_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.memory import BlockManager
from paged.request import Request, SeqStatus, Sequence
from paged.scheduler.policy import SchedulingPolicy


@dataclass
class StepBudget:
    """What is left of one step: tokens, and how many prompts it leaves part-computed."""

    tokens: int
    chunked_prefill: bool
    long_prefill_token_threshold: int
    num_partial: int = 0

    def chunk(self, remaining: int) -> int:
        """Tokens of a prompt (or recomputed sequence) with `remaining` uncomputed ones to run now."""
        if not self.chunked_prefill:
            return remaining
        n = min(remaining, self.tokens)
        return min(n, self.long_prefill_token_threshold) if self.long_prefill_token_threshold else n


def gang_of(seq: Sequence, status: SeqStatus) -> list[Sequence]:
    """`seq` and the other sequences of its request in the same state: they move together."""
    return [seq, *(s for s in seq.request.seqs if s.status is status and s is not seq)]


def seats(gang: list[Sequence]) -> int:
    """Batch seats a request holds: one not yet forked takes those its samples or beams will fill
    (vLLM's max_num_running_seqs), so forking never overfills the batch."""
    return max(len(gang), gang[0].request.params.best_of) if len(gang[0].request.seqs) == 1 else len(gang)


def seats_in_use(running: list[Sequence]) -> int:
    return len(running) + sum(s.request.params.best_of - 1 for s in running if len(s.request.seqs) == 1)


def running_gangs(
    running: list[Sequence], budget: StepBudget, policy: SchedulingPolicy, now: float,
) -> list[list[Sequence]]:
    """The running sequences by request: in the policy's order when the budget cannot hold all
    their rows (who goes first then decides who runs), else in admission order."""
    gangs: dict[Request, list[Sequence]] = {}
    need = 0
    for seq in running:
        gangs.setdefault(seq.request, []).append(seq)
        need += len(seq.token_ids) - seq.num_computed_tokens
    if need <= budget.tokens or len(gangs) <= 1:
        return list(gangs.values())
    return [gangs[s.request] for s in policy.order([g[0] for g in gangs.values()], now)]


def grow(block_manager: BlockManager, gang: list[Sequence]) -> list[tuple[int, int]] | None:
    """A slot for each sequence's next token: the copy-on-write copies to make first, or None
    (nothing changed) when the free blocks do not suffice."""
    if len(gang) == 1:  # checks and grows in one pass
        return block_manager.try_append_slots(gang[0])
    # A group checks first: once one of its sequences has grown (its copy-on-write targets not
    # yet copied), the group could no longer be swapped out whole.
    if not block_manager.can_append_slots(*gang):
        return None
    return [copy for seq in gang for copy in block_manager.append_slots(seq)]
