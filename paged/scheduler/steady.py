"""The steady decode step: the batch of the step before, every row one token again (vLLM V1's
persistent batch, the scheduler's half).

Under load most steps are decode steps in which nothing changed: the same running sequences, each a
lone sequence (best_of 1) decoding one token, nothing waiting or swapped out. Such a step schedules
exactly what the last one did, so the scheduler keeps that step's rows (`ScheduledSeq`s, which
nothing changes once made) and reuses them: no queue walk, no gangs, no new row objects; the block
manager grows the whole batch in one pass (`BlockManager.grow_decodes`), and the update half applies
the tokens with each row's stop rules prepared once (`SteadyRows`). A row that cannot take that
path (its blocks run out, or under async scheduling it has nothing left to compute) hands the rest
of the batch, in order, to the general `_run`, which then does what it would have done for it: the
step is the same, byte for byte, as the general path's (the simulator's outputs depend on it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged.memory import BlockManager
from paged.request import SeqStatus, Sequence
from paged.scheduler.budget import StepBudget
from paged.scheduler.state import SchedulerState
from paged.step import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from paged.memory.block_manager import _SeqBlocks


@dataclass
class SteadyRows:
    """The rows of the last step that were the running sequences in order, each decoding one
    token, and per row what `update_from_output` needs to know that its token stops nothing:
    the tokens that may stop it, and the length that does (0: always ask `check_stop`, for a
    sequence with a detokenizer, whose every token must be fed, or with logprobs to keep)."""

    running: list[Sequence]
    items: list[ScheduledSeq]
    blocks: list[_SeqBlocks]  # each sequence's `BlockManager.seq_blocks`, the same object while it runs
    stops: list[frozenset[int]]
    limits: list[int]


class SteadyMixin(SchedulerState):
    """`Scheduler`'s steady decode step (its base class). `Scheduler.__init__` sets the state it uses."""

    _run: Callable[[SchedulerOutput, StepBudget, list[list[Sequence]], float], None]
    _admit: Callable[[SchedulerOutput, StepBudget, float], None]
    prefill_first: bool
    # None: this scheduler's parts rule the steady step out (`_init_steady`)
    _steady: SteadyRows | None
    # the output of the last step scheduled, when every row of it was a steady row
    _steady_out: SchedulerOutput | None

    def _init_steady(self, allowed: bool) -> None:
        """`allowed`: the parts allow a steady step at all (a plain block manager, whose growth
        `grow_decodes` does, one KV group, no KV press)."""
        self._steady = SteadyRows([], [], [], [], []) if allowed and type(self.block_manager) is BlockManager else None
        self._steady_out = None
        self.num_steady_steps = 0  # steps scheduled from the last step's rows (all or some of them)

    def _run_steady(self, out: SchedulerOutput, budget: StepBudget, now: float) -> bool:
        """Schedule the steady step if this is one (False: it is not, and nothing changed). Rows
        that finished since are left out and sequences that joined the batch since decode after
        the rows through the general path (`_carry_over`); with requests waiting,
        decode-first admits them after the rows as `_schedule_queues` would (there too the rows
        come first: every running gang is one decode, so none is a prompt in progress, and their
        order is admission's)."""
        steady, running = self._steady, self.running
        self._steady_out = None
        if (steady is None or self.swapped or not running or len(running) > budget.tokens
                or (self.waiting and self.prefill_first)):
            return False
        if running != steady.running and not self._carry_over(steady, running):
            return False
        steady = self._steady
        assert steady is not None
        self.num_steady_steps += 1
        num_kept, num_rows = len(steady.running), len(running)  # before the general path preempts any
        grown, copies = self.block_manager.grow_decodes(running[:num_kept], steady.blocks)
        # every row grown this way is a decode: it sampled its last token in the step before
        out.scheduled = steady.items[:grown] if grown < num_kept else list(steady.items)
        out.blocks_to_copy.extend(copies)
        out.num_decode_rows = grown
        budget.tokens -= grown
        if grown < num_rows:
            self._run(out, budget, [[seq] for seq in running[grown:]], now)
        if self.waiting and not self.swapped:  # a preemption may have swapped a row out: no admission
            self._admit(out, budget, now)
        if grown == num_rows == len(out.scheduled):
            self._steady_out = out
        return True

    def _carry_over(self, steady: SteadyRows, running: list[Sequence]) -> bool:
        """Whether `running` is the steady rows' sequences less those that finished since (a step's
        finished rows leave the batch, the rest decode on), then sequences that joined since
        (admitted, their prompts computed), each a lone sequence with one token to compute (the
        general path would make each its own gang, a decode, in this order); if so, the steady
        rows become those of the sequences that stay."""
        kept = [i for i, seq in enumerate(steady.running) if seq.status is not SeqStatus.FINISHED]
        num_kept = len(kept)
        # a sequence compares by identity (it defines no equality): one list comparison, not a walk
        if len(running) < num_kept or running[:num_kept] != [steady.running[i] for i in kept]:
            return False
        if not all(len(seq.request.seqs) == 1 and seq.request.params.best_of == 1
                   and len(seq.token_ids) - seq.num_computed_tokens == 1 for seq in running[num_kept:]):
            return False
        if num_kept < len(steady.running):
            self._steady = SteadyRows(*([rows[i] for i in kept] for rows in (
                steady.running, steady.items, steady.blocks, steady.stops, steady.limits)))
        return True

    def _remember_steady(self, out: SchedulerOutput) -> None:
        """After a step is scheduled: keep its first rows for the next, as far as they are the
        running sequences in order, each a lone sequence decoding one token that it samples."""
        if self._steady is None or self._steady_out is out:
            return
        items, running = out.scheduled, self.running
        num_kept = 0
        for it, seq in zip(items, running):
            if not (it.seq is seq and it.num_new_tokens == 1 and it.num_samples == 1
                    and seq.request.params.best_of == 1):
                break
            num_kept += 1
        running = running[:num_kept]
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        stops, limits = [], []
        for seq in running:
            params = seq.request.params
            # no stop token ids (nearly every row): the EOS set itself, no new set per row per step
            stop_ids = params.stop_token_ids
            stops.append((frozenset(stop_ids) | (frozenset() if params.ignore_eos else eos)) if stop_ids
                         else frozenset() if params.ignore_eos else eos)
            limits.append(0 if seq.detokenizer is not None or seq.logprobs is not None else
                          min(seq.num_prompt_tokens + params.max_tokens, max_model_len))
        bm = self.block_manager
        self._steady = SteadyRows(running, items[:num_kept], list(map(bm.seq_blocks, running)), stops, limits)
        # every row a steady one, each past its first token (which the lean update does not time):
        # this step is applied as a steady one too
        if items and num_kept == len(items) == len(self.running) and all(
                len(seq.token_ids) > seq.num_prompt_tokens for seq in running):
            self._steady_out = out
