"""Sequence groups end to end: parallel sampling (best_of) and beam search under memory pressure.

A request's sequences share blocks (a fork shares its parent's, copied on write) and are admitted,
preempted (recomputed or swapped) and swapped in together. Whatever the cache size, allocator or
preemption mode, every request that is not aborted must get exactly the outputs it gets in a large
cache; no block may leak; and no step may write a block that another table still holds. Below the
engine, a state machine drives groups through a BlockManager with a shadow cache of token ids.
"""

from __future__ import annotations

import copy
import random
import zlib
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.runner import drive
from paged.memory import AllocStatus, BlockManager, NaiveAllocator, NoFreeBlocksError, PrefixCachingAllocator
from paged.request import FinishReason, Request, SamplingParams, Sequence
from paged.step import ExecutorOutput, SchedulerOutput
from tests.hypothesis_budget import examples
from tests.token_cache_executor import TokenCacheExecutor

VOCAB = 50  # small, so stop tokens are hit (ids 0..48 are sampled; 49 is the never-sampled EOS)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SharedBlockWrite(AssertionError):
    """A step wrote a position of a block that another block table still holds."""


class CheckedExecutor(TokenCacheExecutor):
    """The token-cache executor with two additions.

    Before any position is written it checks, against the engine's block manager, that the target
    block has refcount 1 (a shared block is never written) and that every block's refcount is the
    number of tables holding it. Each sampled token gets a log-probability drawn from a hash of the
    context read back through the block table: distinct, so beam search and best_of rankings have
    no ties, and wrong whenever a block holds the wrong tokens.
    """

    block_sizes = (1, 2, 4, 8, 16)

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.block_manager: BlockManager | None = None
        self.num_checked_writes = 0

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        bm = self.block_manager
        assert bm is not None, "attach the engine's block manager first"
        refcount = bm.allocator.refcount
        held = [0] * bm.num_total_blocks
        for state in bm._seqs.values():
            for b in state.table[state.num_dropped :]:
                held[b] += 1
        assert [refcount(b) for b in range(bm.num_total_blocks)] == held, "refcounts differ from the tables"
        bs = self.block_size
        for item in sched.scheduled:
            table = item.block_table
            for pos in range(item.num_computed, item.context_len):
                block = table[pos // bs]
                if refcount(block) != 1:
                    raise SharedBlockWrite(
                        f"step writes position {pos} of {item.seq} into block {block} with refcount {refcount(block)}"
                    )
                self.num_checked_writes += 1
        out = super().execute(sched)
        out.logprobs = [self._logprobs(item.block_table, item.context_len, len(toks))
                        for item, toks in zip(sched.scheduled, out.sampled, strict=True)]
        return out

    def _logprobs(self, table: list[int], context_len: int, num: int) -> list[float]:
        if not num:
            return []
        bs = self.block_size
        context = np.array([self.cache[table[p // bs], p % bs] for p in range(context_len)], dtype=np.int64)
        rng = random.Random(zlib.crc32(context.tobytes()))
        return [-(0.25 * k + rng.random()) for k in range(num)]


@cache
def base_config(allocator: str):
    return compose_config(["model=tiny-random", "logger=none", "progress=false", f"allocator={allocator}"])


def engine_for(
    allocator: str = "naive", *, num_blocks: int = 2048, block_size: int = 16, mode: str = "recompute",
    num_cpu_blocks: int = 0, share_blocks: bool = True,
) -> Engine:
    cfg = copy.deepcopy(base_config(allocator))
    cfg.allocator.num_blocks = num_blocks
    cfg.allocator.block_size = block_size
    cfg.allocator.watermark = 0.0
    cfg.allocator.share_blocks = share_blocks
    cfg.scheduler.preemption_mode = mode
    if num_cpu_blocks:
        cfg.allocator.swap_space = str(num_cpu_blocks * 8 * block_size)  # the executor's bytes per block
    executor = CheckedExecutor()
    engine = build_engine(cfg, executor=executor)
    executor.block_manager = engine.scheduler.block_manager
    if mode != "recompute":
        cpu = engine.scheduler.block_manager.cpu_allocator
        assert cpu is not None and cpu.num_blocks == num_cpu_blocks
    return engine


def run(engine: Engine, specs: list[tuple[list[int], SamplingParams]]) -> list[Request]:
    requests = [Request(f"r{i}", prompt, copy.deepcopy(params)) for i, (prompt, params) in enumerate(specs)]
    for r in requests:
        engine.add_request(r)
    drive(engine)
    return requests


def completions(request: Request) -> list[tuple[list[int], float, FinishReason | None]]:
    return [(list(c.token_ids), c.cumulative_logprob, c.finish_reason) for c in request.outputs()]


def assert_no_leak(engine: Engine) -> None:
    sched = engine.scheduler
    bm = sched.block_manager
    alloc = bm.allocator
    assert not (sched.waiting or sched.running or sched.swapped or sched._groups)
    assert not bm._seqs and not bm.swap_space.parked, "sequences still hold blocks"
    assert alloc.num_free_blocks == bm.num_total_blocks, "device blocks leaked"
    assert all(alloc.refcount(b) == 0 for b in range(bm.num_total_blocks))
    cpu = bm.cpu_allocator
    if cpu is not None:
        assert cpu.num_free_blocks == cpu.num_blocks, "CPU swap blocks leaked"
        assert all(cpu.refcount(b) == 0 for b in range(cpu.num_blocks))
    s = bm.stats()
    assert (s.num_token_slots_used, s.num_reserved_slots, s.num_logical_blocks) == (0, 0, 0)


def sharing_saving_mean(engine: Engine) -> float:
    kv = engine.scheduler.stats().kv
    caches = engine.caches_prefixes
    return engine.metrics.summary(kv_end=kv, caches_prefixes=caches)["kv_sharing_saving_mean"]


# -- workloads ---------------------------------------------------------------------------------------


@st.composite
def request_specs(draw, prefix: list[int]) -> tuple[list[int], SamplingParams]:
    # prompts often start with a common prefix, so the prefix cache has something to share
    head = prefix[: draw(st.integers(0, len(prefix)))]
    prompt = head + draw(st.lists(st.integers(0, 48), min_size=0 if head else 1, max_size=8))
    max_tokens = draw(st.integers(1, 10))
    stop = draw(st.sampled_from([[], [], [draw(st.integers(0, 48))]]))
    kind = draw(st.sampled_from(["single", "parallel", "beam"]))
    if kind == "single":
        params = SamplingParams(temperature=draw(st.sampled_from([0.0, 1.0])), max_tokens=max_tokens,
                                stop_token_ids=stop)
    elif kind == "parallel":
        n = draw(st.integers(2, 4))
        params = SamplingParams(n=n, best_of=n + draw(st.sampled_from([0, 0, 1, 2])), temperature=1.0,
                                seed=draw(st.integers(0, 1000)), max_tokens=max_tokens, stop_token_ids=stop)
    else:
        n = draw(st.integers(2, 4))
        params = SamplingParams(
            n=n, best_of=n + draw(st.sampled_from([0, 0, 1])), use_beam_search=True, temperature=0.0,
            length_penalty=draw(st.sampled_from([1.0, 0.5, 2.0, 0.0, -1.0])),
            early_stopping=draw(st.sampled_from([True, False, "never"])), max_tokens=max_tokens, stop_token_ids=stop,
        )
    return prompt, params


@st.composite
def workloads(draw) -> list[tuple[list[int], SamplingParams]]:
    prefix = draw(st.lists(st.integers(0, 48), min_size=0, max_size=10))
    return draw(st.lists(request_specs(prefix), min_size=1, max_size=6))


def unshared_blocks(prompt: list[int], params: SamplingParams, block_size: int) -> int:
    """Blocks a request needs at its longest with no block shared (after a recompute): every
    sequence's table covers all but its last token (sampled, never written) plus that token's slot."""
    return params.best_of * cdiv(len(prompt) + params.max_tokens - 1, block_size)


# -- 1. engine: tight caches against a large one -----------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), data=st.data())
def test_groups_under_memory_pressure_match_a_large_cache(mode, workload, data):
    reference = run(engine_for(), workload)
    for r in reference:
        assert r.abort_reason is None, r.abort_reason

    allocator = data.draw(st.sampled_from(["naive", "prefix"]), label="allocator")
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    need = max(unshared_blocks(p, sp, block_size) for p, sp in workload)
    # mostly a cache that fits every request alone; sometimes one that some requests cannot get
    extra = data.draw(st.one_of(st.integers(0, 2), st.integers(-need // 2, -1)), label="extra_blocks")
    num_blocks = max(need + extra, 1)
    num_cpu = data.draw(st.integers(1, 2 * num_blocks), label="num_cpu_blocks") if mode != "recompute" else 0
    engine = engine_for(allocator, num_blocks=num_blocks, block_size=block_size, mode=mode, num_cpu_blocks=num_cpu)
    tight = run(engine, workload)

    finished = 0
    for ref, r in zip(reference, tight, strict=True):
        if r.abort_reason is not None:
            assert isinstance(r.abort_reason, str) and r.abort_reason
            assert r.finish_reason is FinishReason.ABORTED
            continue
        finished += 1
        assert completions(r) == completions(ref), f"{r} ({r.params})"
    assert_no_leak(engine)
    counters = engine.scheduler.counters
    event(f"preempted: {counters.num_preemptions > 0}, swapped: {counters.num_swaps_out > 0}")
    if extra >= 0:  # every request fits alone: at least most of them finish
        assert finished * 2 > len(workload), [r.abort_reason for r in tight]
    event(f"aborted with every request fitting alone: {extra >= 0 and finished < len(workload)}")


# Forks, beams and shared prompts under a cache that must preempt: every mode and allocator does.
PRESSURE = [
    ([1, 2, 3, 4, 5, 6, 7], SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=9)),
    ([1, 2, 3, 4, 5, 6, 8], SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8)),
    ([1, 2, 3, 9], SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=7, length_penalty=0.5,
                                  early_stopping=True, stop_token_ids=[7])),
    ([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=10)),
    ([5, 5, 5], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, stop_token_ids=[11])),
]


@pytest.mark.parametrize("allocator", ["naive", "prefix"])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_a_tight_cache_preempts_groups_and_keeps_their_outputs(mode, allocator):
    reference = run(engine_for(), PRESSURE)
    num_cpu = 64 if mode != "recompute" else 0
    # the largest request recomputed (beams no longer sharing) needs 4 x 7 blocks of 2: it fits alone
    assert max(unshared_blocks(p, sp, 2) for p, sp in PRESSURE) == 28
    engine = engine_for(allocator, num_blocks=28, block_size=2, mode=mode, num_cpu_blocks=num_cpu)
    tight = run(engine, PRESSURE)
    assert [r.abort_reason for r in tight] == [None] * len(PRESSURE)
    assert [completions(r) for r in tight] == [completions(r) for r in reference]
    counters = engine.scheduler.counters
    assert counters.num_preemptions > 0
    if mode != "recompute":
        assert counters.num_swaps_out > 0 and counters.num_swaps_in == counters.num_swaps_out
    assert engine.executor.num_checked_writes > 0
    assert_no_leak(engine)


def test_without_sharing_outputs_are_the_same_and_the_saving_is_lower():
    shared_engine = engine_for("prefix", block_size=4)
    shared = run(shared_engine, PRESSURE)
    unshared_engine = engine_for("prefix", block_size=4, share_blocks=False)
    unshared = run(unshared_engine, PRESSURE)
    reference = run(engine_for(), PRESSURE)
    assert [completions(r) for r in shared] == [completions(r) for r in reference]
    assert [completions(r) for r in unshared] == [completions(r) for r in reference]
    assert sharing_saving_mean(unshared_engine) < sharing_saving_mean(shared_engine)
    # and under pressure, swapping
    tight = engine_for("naive", num_blocks=28, block_size=2, mode="swap", num_cpu_blocks=64, share_blocks=False)
    assert [completions(r) for r in run(tight, PRESSURE)] == [completions(r) for r in reference]
    assert tight.scheduler.counters.num_preemptions > 0
    assert_no_leak(shared_engine)
    assert_no_leak(unshared_engine)
    assert_no_leak(tight)


def test_forked_samples_count_against_max_num_seqs():
    """A best_of request is admitted as one sequence but takes the seats of the samples it forks."""
    engine = engine_for()
    engine.scheduler.max_num_seqs = 4
    specs = [([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))] * 3
    specs.append(([4, 5], SamplingParams(n=4, temperature=1.0, max_tokens=5)))
    specs.append(([6, 7], SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=5)))
    requests = [Request(f"r{i}", p, copy.deepcopy(sp)) for i, (p, sp) in enumerate(specs)]
    for r in requests:
        engine.add_request(r)
    most = 0
    while engine.has_unfinished:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most <= 4, f"{most} sequences running with max_num_seqs=4"
    assert [r.abort_reason for r in requests] == [None] * len(specs)
    assert_no_leak(engine)


# -- 3. beam search shares blocks --------------------------------------------------------------------


def test_beam_search_shares_blocks_on_most_decode_steps():
    prompt = list(range(1, 21))  # five full blocks of 4 that every beam shares
    params = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=16, early_stopping="never")
    engine = engine_for("naive", block_size=4)
    (beams,) = run(engine, [(prompt, params)])
    decode = [s for s in engine.metrics.steps if not s.is_prefill]
    assert len(decode) >= 10
    sharing = [s for s in decode if s.kv_sharing_saving > 0]
    assert len(sharing) * 4 >= len(decode) * 3, [s.kv_sharing_saving for s in decode]
    assert len(beams.outputs()) == 4

    baseline = engine_for("naive", block_size=4, share_blocks=False)
    (unshared,) = run(baseline, [(prompt, params)])
    assert completions(unshared) == completions(beams)
    assert sharing_saving_mean(baseline) < sharing_saving_mean(engine)
    assert_no_leak(engine)
    assert_no_leak(baseline)


# -- 2. block manager: groups of sequences ----------------------------------------------------------


PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class GroupMachine(RuleBasedStateMachine):
    """Requests with several sequences over a BlockManager, as the scheduler drives them.

    `kv[block][slot]` is the token id a step wrote there and `cpu_kv` the CPU pool's copy. A running
    sequence has computed all its tokens but the last (sampled, written by its next step). Groups
    are admitted together (prefill), step together (a group checks `can_append_slots(*seqs)` and
    then grows each; a lone sequence uses `try_append_slots`), fork (a child sharing its parent's
    blocks with another last token), prune, are swapped out and in together or recomputed, or
    aborted in any state.
    """

    @initialize(
        cls=st.sampled_from([NaiveAllocator, PrefixCachingAllocator]),
        num_blocks=st.integers(1, 16),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.sampled_from([0, 2, 6, 12, 24]),
        share=st.sampled_from([True, True, False]),
        prompts=st.lists(PROMPTS, min_size=1, max_size=3),
    )
    def setup(self, cls, num_blocks, block_size, num_cpu_blocks, share, prompts):
        self.bm = BlockManager(cls(num_blocks=num_blocks, block_size=block_size), 0.0,
                               num_cpu_blocks=num_cpu_blocks, share_blocks=share)
        self.alloc = self.bm.allocator
        self.cpu = self.bm.cpu_allocator
        self.n, self.bs, self.num_cpu = num_blocks, block_size, num_cpu_blocks
        self.kv: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.cpu_kv: dict[int, list] = {b: [None] * block_size for b in range(num_cpu_blocks)}
        self.groups: dict[Request, list[Sequence]] = {}  # live sequences of each request
        self.where: dict[Request, str] = {}  # waiting | running | swapped
        self.covered: dict[int, int] = {}  # seq id -> token slots its table covers
        self.cpu_tables: dict[int, list[int]] = {}  # seq id -> its CPU blocks while swapped
        self.best_of: dict[Request, int] = {}  # samples still to fork off the prompt after the prefill
        self.num_requests = 0
        for prompt in prompts:
            self.add(prompt)

    # -- helpers

    def in_state(self, where: str) -> list[Request]:
        return [r for r in self.groups if self.where[r] == where]

    def running_seqs(self) -> list[Sequence]:
        return [s for r in self.in_state("running") for s in self.groups[r]]

    def swapped_seqs(self) -> list[Sequence]:
        return [s for r in self.in_state("swapped") for s in self.groups[r]]

    def filled(self, seq: Sequence) -> list[int]:
        return self.bm.block_table(seq)[: cdiv(self.covered[seq.seq_id], self.bs)]

    def compute(self, seqs: list[Sequence], copies: list[tuple[int, int]], data) -> None:
        """One step of `seqs`: block copies first, then every uncomputed position, then a sample."""
        for src, dst in copies:
            assert self.alloc.refcount(dst) == 1, "a copy-on-write target is shared"
            self.kv[dst] = list(self.kv[src])
        bs = self.bs
        for seq in seqs:
            table = self.bm.block_table(seq)
            assert len(table) == cdiv(seq.num_tokens, bs)
            self.covered[seq.seq_id] = seq.num_tokens
            for pos in range(seq.num_computed_tokens, seq.num_tokens):
                block = table[pos // bs]
                assert self.alloc.refcount(block) == 1, f"write into block {block} shared by other tables"
                self.kv[block][pos % bs] = seq.token_ids[pos]
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
            self.bm.mark_computed(seq)
            seq.token_ids.append(data.draw(st.integers(0, 2), label="sampled token"))

    def drop(self, request: Request) -> None:
        for seq in self.groups.pop(request):
            self.covered.pop(seq.seq_id, None)
            self.cpu_tables.pop(seq.seq_id, None)
        del self.where[request]
        del self.best_of[request]

    # -- rules

    def pick(self, data, where: str) -> Request | None:
        """A group in state `where`. With none, some group moves on instead (admitted, stepped or
        swapped in; a new one is added when none is left): rules stay enabled, steps are not wasted."""
        groups = self.in_state(where)
        if groups:
            return data.draw(st.sampled_from(groups), label=f"{where} group")
        self.advance(data)
        return None

    @precondition(lambda self: len(self.groups) < 4)
    @rule(prompt=PROMPTS, best_of=st.integers(1, 4))
    def add(self, prompt, best_of=1):
        """A request; with best_of > 1 its first step forks the other samples off the prompt."""
        self.num_requests += 1
        request = Request(f"r{self.num_requests}", prompt, SamplingParams(temperature=0.0, max_tokens=64))
        self.groups[request] = list(request.seqs)
        self.where[request] = "waiting"
        self.best_of[request] = best_of

    @rule(data=st.data())
    def advance(self, data):
        """Whatever comes next for a group: admission, a decode step, a swap-in."""
        if not self.groups:
            self.add(data.draw(PROMPTS, label="prompt"))
        request = data.draw(st.sampled_from(list(self.groups)), label="group")
        {"waiting": self.admit_group, "running": self.step_group, "swapped": self.swap_in_group}[
            self.where[request]](request, data)

    @rule(data=st.data())
    def admit(self, data):
        request = self.pick(data, "waiting")
        if request is not None:
            self.admit_group(request, data)

    def admit_group(self, request: Request, data) -> None:
        """Admit a waiting group (new, or recomputed) and run its prefill."""
        gang = self.groups[request]
        status = self.bm.can_allocate(*gang)
        required = sum(map(self.bm.admission_blocks, gang))
        assert required == sum(cdiv(s.num_tokens, self.bs) for s in gang)
        assert (status is AllocStatus.NEVER) == (required > self.n)
        if status is not AllocStatus.OK:
            return
        for seq in gang:
            hit = self.bm.allocate(seq)  # OK for the group: no member may fail
            assert hit % self.bs == 0 and 0 <= hit < seq.num_tokens
            seq.num_computed_tokens = hit
            if hit:
                event("admit: prefix hit")
        event(f"admit: group of {min(len(gang), 3)}+")
        self.compute(gang, [], data)
        self.where[request] = "running"
        if self.best_of[request] > 1:  # a new request: the other samples fork off its first sequence
            (first,) = gang
            for _ in range(self.best_of[request] - 1):
                self.fork_seq(request, first, data.draw(st.integers(0, 2), label="sampled token"))
            self.best_of[request] = 1

    @rule(data=st.data())
    def step(self, data):
        request = self.pick(data, "running")
        if request is not None:
            self.step_group(request, data)

    def step_group(self, request: Request, data) -> None:
        """A decode step of one group: each live sequence writes its last token."""
        gang = self.groups[request]
        tables = [list(self.bm.block_table(s)) for s in gang]
        if len(gang) == 1:
            copies = self.bm.try_append_slots(gang[0])
            if copies is None:
                assert self.bm.block_table(gang[0]) == tables[0]
                return
        else:
            if not self.bm.can_append_slots(*gang):
                assert [self.bm.block_table(s) for s in gang] == tables
                return
            copies = [c for seq in gang for c in self.bm.append_slots(seq)]  # must not raise
        event(f"step: {'lone' if len(gang) == 1 else 'group'}, {'copies' if copies else 'no copy'}")
        self.compute(gang, copies, data)

    @rule(data=st.data(), token=st.integers(0, 2))
    def fork(self, data, token):
        """A sample or beam branches: the child shares the parent's blocks, with its own last token."""
        request = self.pick(data, "running")
        if request is None or len(self.running_seqs()) >= 8:
            return
        self.fork_seq(request, data.draw(st.sampled_from(self.groups[request])), token)

    def fork_seq(self, request: Request, parent: Sequence, token: int) -> None:
        before = [self.alloc.refcount(b) for b in self.bm.block_table(parent)]
        child = parent.fork(request.next_seq_index())
        child.token_ids[-1] = token
        request.seqs.append(child)
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert [self.alloc.refcount(b) for b in self.bm.block_table(child)] == [r + 1 for r in before]
        self.covered[child.seq_id] = self.covered[parent.seq_id]
        self.groups[request].append(child)

    @rule(data=st.data())
    def prune_or_finish(self, data):
        """A beam without children, or a finished sample: its blocks go, shared ones stay."""
        request = self.pick(data, "running")
        if request is None:
            return
        seq = data.draw(st.sampled_from(self.groups[request]))
        others = [b for s in self.groups[request] if s is not seq for b in self.bm.block_table(s)]
        self.bm.free(seq)
        assert not self.bm.has_blocks(seq)
        with pytest.raises(KeyError):
            self.bm.free(seq)
        for b in set(others):
            assert self.alloc.refcount(b) > 0, "a block the others hold was freed"
        self.groups[request].remove(seq)
        request.seqs.remove(seq)
        del self.covered[seq.seq_id]
        if not self.groups[request]:
            self.drop(request)

    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        request = self.pick(data, "running")
        if request is None:
            return
        for seq in self.groups[request]:
            self.bm.free(seq)
            assert not self.bm.has_blocks(seq)
            seq.num_computed_tokens = 0
            del self.covered[seq.seq_id]
        self.where[request] = "waiting"

    @precondition(lambda self: self.cpu is not None)
    @rule(data=st.data())
    def swap_out(self, data):
        """Swap a whole group out: a block its sequences share moves once and stays shared."""
        request = self.pick(data, "running")
        if request is None:
            return
        gang = self.groups[request]
        filled = {s.seq_id: self.filled(s) for s in gang}
        moved = list(dict.fromkeys(b for s in gang for b in filled[s.seq_id]))
        can = self.bm.can_swap_out(*gang)
        assert can == (len(moved) <= self.cpu.num_free_blocks)
        if not can:
            with pytest.raises(NoFreeBlocksError):
                self.bm.swap_out(*gang)
            return
        pairs = self.bm.swap_out(*gang)
        event(f"swap out: {'shared blocks' if len(moved) < sum(map(len, filled.values())) else 'nothing shared'}")
        assert [device for device, _ in pairs] == moved
        assert len({cpu for _, cpu in pairs}) == len(pairs)
        to_cpu = dict(pairs)
        for device, cpu in pairs:
            self.cpu_kv[cpu] = list(self.kv[device])
        for seq in gang:
            assert self.bm.is_swapped(seq) and self.bm.has_blocks(seq)
            self.cpu_tables[seq.seq_id] = [to_cpu[b] for b in filled[seq.seq_id]]
        self.where[request] = "swapped"

    @rule(data=st.data())
    def swap_in(self, data):
        request = self.pick(data, "swapped")
        if request is not None:
            self.swap_in_group(request, data)

    def swap_in_group(self, request: Request, data) -> None:
        """Bring a group back: blocks it shared and only reads are shared again; each sequence gets
        its own copy of the blocks its next step writes."""
        gang = self.groups[request]
        bs = self.bs
        read_only = {b for s in gang for b in self.cpu_tables[s.seq_id][: s.num_computed_tokens // bs]}
        written = sum(cdiv(s.num_tokens, bs) - min(s.num_computed_tokens // bs, len(self.cpu_tables[s.seq_id]))
                      for s in gang)
        required = len(read_only) + written
        status = self.bm.can_swap_in(*gang)
        if required > self.n:
            assert status is AllocStatus.NEVER
        else:
            assert status is (AllocStatus.OK if required <= self.alloc.num_free_blocks else AllocStatus.LATER)
        event(f"swap in: {status.value}")
        if status is AllocStatus.LATER:
            with pytest.raises(NoFreeBlocksError):
                self.bm.swap_in(*gang)
            assert all(self.bm.is_swapped(s) for s in gang)
            return
        if status is AllocStatus.NEVER:  # the scheduler aborts it
            self.abort_request(request)
            return
        free_before = self.alloc.num_free_blocks
        pairs = self.bm.swap_in(*gang)
        assert free_before - self.alloc.num_free_blocks == required
        if len(read_only) < sum(min(s.num_computed_tokens // bs, len(self.cpu_tables[s.seq_id])) for s in gang):
            event("swap in: shared again")
        for cpu, device in pairs:
            self.kv[device] = list(self.cpu_kv[cpu])
        to_device: dict[int, int] = {}
        for seq in gang:
            table = self.bm.block_table(seq)
            assert len(table) == cdiv(seq.num_tokens, bs)
            first_written = seq.num_computed_tokens // bs
            for i, cpu in enumerate(self.cpu_tables[seq.seq_id]):
                if i < first_written:
                    assert to_device.setdefault(cpu, table[i]) == table[i], "a shared block came back unshared"
            for b in table[first_written:]:
                assert self.alloc.refcount(b) == 1, "a block the next step writes came back shared"
            self.covered[seq.seq_id] = seq.num_tokens
            del self.cpu_tables[seq.seq_id]
            assert not self.bm.is_swapped(seq)
        self.where[request] = "running"

    @precondition(lambda self: len(self.groups) >= 3)  # rarely: teardown aborts the rest
    @rule(data=st.data())
    def abort(self, data):
        self.abort_request(data.draw(st.sampled_from(list(self.groups))))

    def abort_request(self, request: Request) -> None:
        event(f"abort: {self.where[request]}")
        for seq in self.groups[request]:
            if self.bm.has_blocks(seq):
                self.bm.free(seq)
            assert not self.bm.has_blocks(seq)
        self.drop(request)

    # -- invariants

    @invariant()
    def refcounts_match_tables_and_nothing_leaks(self):
        refs = [0] * self.n
        for seq in self.running_seqs():
            for b in self.bm.block_table(seq):
                refs[b] += 1
        assert [self.alloc.refcount(b) for b in range(self.n)] == refs
        free_ids = list(self.alloc.free_ids()) if isinstance(self.alloc, NaiveAllocator) else [
            *self.alloc._hashless, *(b for b in range(self.alloc.num_blocks) if b in self.alloc.eviction)]
        assert len(free_ids) == len(set(free_ids)) == self.alloc.num_free_blocks
        assert set(free_ids) == {b for b in range(self.n) if refs[b] == 0}, "a block is neither free nor held"
        assert self.alloc.num_free_blocks + sum(1 for r in refs if r) == self.n
        for request in self.in_state("waiting"):
            assert not any(self.bm.has_blocks(s) for s in self.groups[request])
        if self.cpu is not None:
            cpu_refs = [0] * self.num_cpu
            for seq in self.swapped_seqs():
                assert self.bm.is_swapped(seq)
                for b in self.cpu_tables[seq.seq_id]:
                    cpu_refs[b] += 1
            assert [self.cpu.refcount(b) for b in range(self.num_cpu)] == cpu_refs
            assert sorted(self.cpu.free_ids()) == [b for b in range(self.num_cpu) if cpu_refs[b] == 0]
        s = self.bm.stats()
        assert s.num_logical_blocks == sum(len(self.bm.block_table(q)) for q in self.running_seqs())
        assert s.num_allocated_blocks == sum(1 for r in refs if r)

    @invariant()
    def sequences_read_their_own_tokens(self):
        bs = self.bs
        for seq in self.running_seqs():
            table = self.bm.block_table(seq)
            assert [self.kv[table[p // bs]][p % bs] for p in range(seq.num_computed_tokens)] == \
                seq.token_ids[: seq.num_computed_tokens]
        for seq in self.swapped_seqs():
            cpu = self.cpu_tables[seq.seq_id]
            assert [self.cpu_kv[cpu[p // bs]][p % bs] for p in range(seq.num_computed_tokens)] == \
                seq.token_ids[: seq.num_computed_tokens]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for request in list(self.groups):
            self.abort_request(request)
        assert self.alloc.num_free_blocks == self.n
        assert all(self.alloc.refcount(b) == 0 for b in range(self.n))
        if self.cpu is not None:
            assert self.cpu.num_free_blocks == self.num_cpu
        s = self.bm.stats()
        assert (s.num_allocated_blocks, s.num_token_slots_used, s.num_reserved_slots) == (0, 0, 0)


GroupMachine.TestCase.settings = settings(max_examples=examples(120), stateful_step_count=40, deadline=None)
TestGroupMachine = GroupMachine.TestCase
