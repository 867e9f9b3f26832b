"""Disaggregated prefill and decode (`paged.cluster.disaggregated`): a request crosses from one
scheduler to another with its KV, the half of `Scheduler` that lets it leave and arrive.

A prefill-pool scheduler (`hands_off`) stops a request at its first token unless that token ends
it: the request leaves its queues (`take_handoffs`) but keeps its blocks while its KV is copied
out, until `release`. A decode-pool scheduler takes such a request with its prompt computed
elsewhere: `reserve` gives it blocks for its prompt and first token only when the cache can hold
them above the watermark and a seat is free, and holds them while its KV arrives; `start_decode`
then runs it from its first token as if it had computed the prompt itself. One sequence per
request (no samples or beams): a hand-off moves one block table. The decode side's prefix cache
is not consulted for what the transfer could skip: every prompt block crosses.
"""

from __future__ import annotations

from paged.memory import AllocStatus
from paged.request import Request, SeqStatus, Sequence
from paged.scheduler.budget import seats_in_use
from paged.scheduler.sequence_group import make_group
from paged.scheduler.state import SchedulerState


class HandoffMixin(SchedulerState):
    """`Scheduler`'s hand-off half (a base class). `Scheduler.__init__` sets the state it changes."""

    max_num_seqs: int
    # prefill pool: requests stop at their first token (set by the fleet that builds the pool)
    hands_off: bool
    handed_off: list[Request]  # stopped since the last `take_handoffs`, their blocks still held
    receiving: list[Sequence]  # decode pool: blocks reserved, KV on its way

    def _hand_off(self, seq: Sequence) -> None:
        """`seq` sampled its first token and goes on elsewhere: out of the queues, blocks kept."""
        request = seq.request
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        del self._groups[request]
        self.policy.on_finished(request, self._now)
        self.handed_off.append(request)

    def take_handoffs(self) -> list[Request]:
        """The requests handed off since the last call, each still holding its blocks here."""
        handed, self.handed_off = self.handed_off, []
        return handed

    def release(self, request: Request) -> None:
        """Free a handed-off request's blocks: its KV has been copied out."""
        for seq in request.seqs:
            self.block_manager.free(seq)

    def reserve(self, request: Request) -> AllocStatus:
        """Decode pool: OK gives `request` (prompt computed elsewhere, first token sampled) its
        blocks, held until `start_decode`; LATER: not now (the watermark, or no free seat); NEVER:
        this cache can never hold it. Nothing changes unless OK."""
        (seq,) = request.seqs
        if seats_in_use(self.running) + len(self.receiving) >= self.max_num_seqs:
            return AllocStatus.LATER
        status = self.block_manager.can_allocate(seq)
        if status is AllocStatus.OK:
            self.block_manager.allocate(seq)
            self.receiving.append(seq)
        return status

    def start_decode(self, request: Request, now: float) -> None:
        """`request`'s KV has arrived: it runs from its first token, its prompt computed."""
        (seq,) = request.seqs
        self.receiving.remove(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.mark_computed(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._groups[request] = make_group(request, self.eos_token_ids, self.max_model_len)
        self.policy.on_add(request, now)
