"""The costs of a fast-forward window's steps, one after another: `CostModel.decode_step` of
`contexts + j` for j = 0, 1, ..., to the bit, computed for many steps in one call.

Every row is one token longer each step, so the longest context grows by one and the tokens read
by the batch's size; the partial rows that v2 and v3 merge (ceil(context / d) per row, for a
partition or split of d tokens) grow by the rows whose context had just filled a multiple of d,
counted from a histogram of the contexts modulo d; these sums are carried from call to call of a
window (`StepSums`). What depends on the batch size and longest
context alone (the kernel version, its largest unit and split, the kernel table's efficiency) is
kept per (rows, longest) for all cost models alike (a fleet's replicas), what depends on the size
alone per size. The attention's bytes are the same integers `decode_work` sums, and every float
operation after them is `decode_step`'s, in its order; no step builds a `StepCost` (the totals,
model times and versions are what the clock and the statistics read; the last one's is built
when `SimExecutor.last_cost` is read). Block-sparse attention's reads are floats summed over the rows:
it is priced by `decode_step` itself each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.kernels import step_version
from paged.sim.cost_model import _KERNELS_PER_LAYER, CostModel, StepCost
from paged.sim.decode_attention import _PARTIAL_FLOAT_BYTES, unit_split
from paged.sim.kernel_table import shape_class

# plans kept per (block size, rows) before they are dropped (a bound on memory)
_MAX_PLANS = 1 << 17
# the plans of every cost model of one GPU, kernel choice and shape (a fleet's replicas share them), by rows
_PLANS: dict[tuple[object, ...], dict[int, tuple[str, int, int, float, float]]] = {}


@dataclass(slots=True)
class StepTotals:
    """A call's steps: each one's end on the clock (the start plus each step's total, added in
    turn, as `VirtualClock.advance` adds them), model time (total less overhead) and kernel
    version; the last step's whole cost."""

    ends: list[float]
    model_times: list[float]
    versions: list[str | None]
    last: StepCost | None = None  # where the steps were priced one by one, else built on demand (`last_cost`)
    last_attention: float = 0.0
    n: int = 0

    def last_cost(self, model: CostModel) -> StepCost:
        """The last step's whole cost (`decode_step`'s)."""
        if self.last is None:
            self.last = model.decode_cost_of(self.n, self.last_attention, self.versions[-1])  # type: ignore[arg-type]
        return self.last


class StepSums:
    """A window's rows' sums, carried from one call of `step_costs` to the next (the rows stay, each
    a token longer a step): the contexts at its first step (`base`), their longest and total, and
    for the latest partition or split `d` (0: none yet) the base's residues mod d and the partial
    rows merged `at` a step past the base."""

    __slots__ = ("base", "n", "longest", "read", "d", "residues", "at", "merged")

    def __init__(self, base: list[int]) -> None:
        self.base, self.n, self.longest, self.read = base, len(base), max(base), sum(base)
        self.d, self.residues, self.at, self.merged = 0, {}, -2, 0  # at = -2: no step's merged yet

    def merged_at(self, d: int, at: int) -> int:
        """sum(ceil((c + at) / d) for c in base): from the previous step's with the same d, it grows
        by the rows whose context had just filled a multiple of d (c + at - 1 = 0 mod d)."""
        if d != self.d:
            self.d, self.at, self.residues = d, -2, {}
            residues = self.residues
            for c in self.base:
                residues[c % d] = residues.get(c % d, 0) + 1
        if self.at == at - 1:
            self.merged += self.residues.get((1 - at) % d, 0)
        elif self.at != at:
            self.merged = sum(-(-(c + at) // d) for c in self.base)
        self.at = at
        return self.merged


def _plan(model: CostModel, block_size: int, n: int, longest: int) -> tuple[str, int, int, float, float]:
    """The kernel version of a step of `n` rows whose longest context is `longest`, its largest
    unit's tokens, the tokens a context is cut into partial rows by (0: none), the divisor of its
    bytes (bandwidth x the kernel table's efficiency) and its layer's launch floor."""
    hw = model.hw
    version = step_version(model.version, longest, n, model.heads, model.partition_size, backend=model.backend)
    unit, d = unit_split(version, n, longest, model.attention_shape(block_size), hw.num_sms)
    efficiency = model.kernel_table[version, shape_class(n, longest)].efficiency
    kernels = _KERNELS_PER_LAYER + (version == "v2")
    return version, unit, d, hw.memory_bandwidth * efficiency, kernels * hw.kernel_launch_s


def _size(model: CostModel, block_size: int, n: int) -> tuple[Any, ...]:
    """What a step of `n` rows costs whatever their contexts: the plans by longest context (shared
    by every cost model of the same GPU, kernel choice and shape), the layers, `decode_work`'s
    integer factors (traffic = read x per_read + per_step, the unit's floor = unit x per_unit, the
    merge's bytes = heads x (partials x per_partial + per_merge)) and `decode_parts`' times."""
    shape = model.attention_shape(block_size)
    head_dim, kv_bytes, L = shape.head_dim, shape.kv_bytes, model.spec.num_layers
    # the kernel table, the plans' other input, is `decode_table(model.hw)`'s
    key = (model.hw, model.version, model.heads, model.partition_size, model.backend, shape, n)
    linear, elementwise, communication, head, overhead = model.decode_parts(n)
    return (
        _PLANS.setdefault(key, {}), L, 2 * shape.kv_heads * head_dim * kv_bytes,
        2 * n * shape.heads * head_dim * shape.dtype_bytes, 2 * head_dim * kv_bytes * model.hw.num_sms,
        (2 + head_dim) * _PARTIAL_FLOAT_BYTES, n * head_dim * shape.dtype_bytes, shape.heads,
        linear, elementwise, communication, head, overhead, L * linear, L * elementwise,
    )


def step_costs(model: CostModel, sums: StepSums, offset: int, block_size: int, cap: int, start: float, until: float
               ) -> StepTotals:
    """`model.decode_step([c + offset + j for c in sums.base], block_size)` for j = 0, 1, ...: the
    first step, then those that start (at the previous one's end) before `until`, at most `cap`."""
    out = StepTotals([], [], [])
    ends, model_times, versions = out.ends, out.model_times, out.versions
    t = start
    if model.blocksparse is not None:
        for j in range(cap):
            if j and t >= until:
                break
            cost = model.decode_step([c + offset + j for c in sums.base], block_size)
            t += cost.total_s
            ends.append(t)
            model_times.append(cost.total_s - cost.overhead_s)
            versions.append(cost.decode_version)
            out.last = cost
        return out
    n = sums.n
    size = model._decode_sizes.get((block_size, n))
    if size is None:
        size = model._decode_sizes[block_size, n] = _size(model, block_size, n)
    (plans, L, per_read, per_step, per_unit, per_partial, per_merge, heads, linear, elementwise, communication, head,
     overhead, l_linear, l_elementwise) = size
    if len(plans) > _MAX_PLANS:
        plans.clear()
    longest, read = sums.longest, sums.read
    attention = 0.0
    version = None
    for at in range(offset, offset + cap):
        if at > offset and t >= until:
            break
        plan = plans.get(longest + at)
        if plan is None:
            plan = plans[longest + at] = _plan(model, block_size, n, longest + at)
        version, unit, d, divisor, launch = plan
        traffic = (read + n * at) * per_read + per_step
        work = max(traffic, unit * per_unit)
        if d:
            work += heads * (sums.merged_at(d, at) * per_partial + per_merge)
        attention = work / divisor
        # `decode_cost_of`'s StepCost and its total_s, term by term in their order
        layer = max(linear + attention + elementwise, launch)
        total = (l_linear + L * attention + l_elementwise + L * (layer - linear - attention - elementwise)
                 + communication + head + overhead + 0.0 + 0.0)
        t += total
        ends.append(t)
        model_times.append(total - overhead)
        versions.append(version)
    if ends:
        out.last_attention, out.n = attention, n
    return out
