"""The costs of a fast-forward window's steps, one after another: `CostModel.decode_step` of
`contexts + j` for j = 0, 1, ..., to the bit, with the attention's sums kept as the contexts grow
instead of taken over every row each step.

Every row is one token longer each step, so the longest context grows by one and the tokens read
by the batch's size; the partial rows that v2 and v3 merge (ceil(context / d) per row, for a
partition or split of d tokens) grow by the rows whose context had just filled a multiple of d,
counted from a histogram of the contexts modulo d. The values are the same integers `decode_step`
sums, so every float operation after them is the same. Block-sparse attention's reads are floats
summed over the rows: it is priced by `decode_step` itself each step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from paged.kernels import step_version
from paged.sim.cost_model import CostModel, StepCost
from paged.sim.decode_attention import decode_work, unit_split
from paged.sim.kernel_table import shape_class


class _Partials:
    """sum(ceil((c + j) / d) for c in contexts) for one d, kept as j grows."""

    def __init__(self, contexts: list[int], d: int, j: int) -> None:
        self.d, self.j = d, j
        self.total = sum(-(-(c + j) // d) for c in contexts)
        self.residues = Counter(c % d for c in contexts)

    def at(self, j: int) -> int:
        d, residues = self.d, self.residues
        while self.j < j:
            self.j += 1
            # ceil((c + j) / d) grows by one where c + j - 1 is a multiple of d
            self.total += residues[(1 - self.j) % d]
        return self.total


def decode_steps(model: CostModel, contexts: list[int], block_size: int) -> Iterator[StepCost]:
    """`model.decode_step([c + j for c in contexts], block_size)` for j = 0, 1, ... (endless)."""
    if model.blocksparse is not None:
        j = 0
        while True:
            yield model.decode_step([c + j for c in contexts] if j else contexts, block_size)
            j += 1
    n, hw = len(contexts), model.hw
    shape = model.attention_shape(block_size)
    longest, read = max(contexts), sum(contexts)
    partials: dict[int, _Partials] = {}
    j = 0
    while True:
        version = step_version(model.version, longest, n, model.heads, model.partition_size, backend=model.backend)
        unit, d = unit_split(version, n, longest, shape, hw.num_sms)
        merged = 0
        if d:
            kept = partials.get(d)
            if kept is None:
                kept = partials[d] = _Partials(contexts, d, j)
            merged = kept.at(j)
        work = decode_work(n, unit, merged, read, shape, hw.num_sms)
        efficiency = model.kernel_table[version, shape_class(n, longest)].efficiency
        yield model.decode_cost_of(n, work / (hw.memory_bandwidth * efficiency), version)
        j += 1
        longest += 1
        read += n
