"""The step statistics summary.json needs, streamed from each `StepRecord` as it is made.

A fleet hour is millions of steps; one record object per step held them in gigabytes. Here a step
costs a few numbers in typed arrays (about 100 bytes), and the summary is computed from them with
the same arithmetic, in the same order, as from the records: np.mean over the same values, running
sums in step order (Python 3.11's `sum` of floats is that plain left-to-right addition), so a
summary is byte-identical whether the records were kept or not. np.mean's pairwise sum depends on
how many values there are, so the columns are kept whole, but not in memory: every `SPILL_STEPS`
steps they are written to a temporary file (a fleet hour's 6.65M steps would hold ~700 MB) and read
back one at a time for the summary.
"""

from __future__ import annotations

import tempfile
from array import array
from typing import IO, Any

import numpy as np

from paged.engine.step_record import StepRecord
from paged.step import KVStats

# StepRecord fields averaged into summary.json as `<key>_mean` (shares of the whole KV pool)
BREAKDOWN_KEYS = (
    "kv_token_state_fraction", "kv_reserved_fraction", "kv_internal_frag_fraction", "kv_external_frag_fraction",
    "kv_free_fraction",
)


# steps between two spills of the value columns to their file (a few MB of them held at most)
SPILL_STEPS = 1 << 16


def _mean(values: Any) -> float | None:
    return float(np.mean(values)) if len(values) else None


class StepStats:
    """Counts, sums, maxima and the value columns that summary.json's step keys are computed from;
    plus the progress bar's running totals (input and sampled tokens, the latest step end)."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.computed_tokens = 0
        self.step_time_s = 0.0
        self.overhead_s = 0.0
        self.kv_usage_max = 0.0
        self.kv_tokens_held_max = 0
        self.decode_versions = {"v1": 0, "v2": 0, "v3": 0}
        self.input_tokens = 0
        self.sampled_tokens = 0
        self.latest_time_s = -np.inf
        self._kv_usage = array("d")
        self._breakdown = {key: array("d") for key in BREAKDOWN_KEYS}
        self._breakdown_columns = tuple(self._breakdown.values())
        self._token_state = array("d")  # over the steps that hold blocks
        self._token_state_of_used = array("d")  # over the steps that use any KV memory
        self._sharing_saving = array("d")  # over the steps whose sequences hold blocks
        self._num_running = array("q")
        self._tokens_held = array("q")
        self._decode_rows = array("q")  # over the steps with decode rows
        self._held_blocks = array("q")  # allocated blocks and tokens held, over the steps that hold tokens
        self._held_tokens = array("q")
        self._columns = [
            self._kv_usage, *self._breakdown.values(), self._token_state, self._token_state_of_used,
            self._sharing_saving, self._num_running, self._tokens_held, self._decode_rows, self._held_blocks,
            self._held_tokens,
        ]
        self._spill: IO[bytes] | None = None  # the columns' earlier values, chunk after chunk
        self._chunks: list[list[tuple[int, int]]] = [[] for _ in self._columns]  # per column: (offset, count)

    def add(self, s: StepRecord) -> None:
        self.count(record_step(s))

    def count(self, step: tuple[Any, ...]) -> None:
        """Count a step: its computed tokens, time, overhead, input and sampled tokens, end, KV usage,
        the five KV shares, allocated blocks, token-state fraction, logical blocks, sharing saving,
        running sequences, tokens held, decode rows and kernel version (as `add` reads them from a
        record, `decode_step` gives them, and `HeldSteps` holds them)."""
        (computed_tokens, step_time_s, overhead_s, input_tokens, sampled_tokens, time_s, kv_usage, shares,
         num_allocated_blocks, token_state_fraction, num_logical_blocks, sharing_saving, num_running, tokens_held,
         num_decode_rows, attention_version) = step
        self.num_steps += 1
        self.computed_tokens += computed_tokens
        self.step_time_s += step_time_s
        self.overhead_s += overhead_s
        self.input_tokens += input_tokens
        self.sampled_tokens += sampled_tokens
        # `max` as written out: each keeps the held value unless the new one is greater
        if time_s > self.latest_time_s:
            self.latest_time_s = time_s
        self._kv_usage.append(kv_usage)
        if kv_usage > self.kv_usage_max:
            self.kv_usage_max = kv_usage
        token, reserved, internal, external, free = shares
        token_col, reserved_col, internal_col, external_col, free_col = self._breakdown_columns
        token_col.append(token)
        reserved_col.append(reserved)
        internal_col.append(internal)
        external_col.append(external)
        free_col.append(free)
        if num_allocated_blocks > 0:
            self._token_state.append(token_state_fraction)
        # in use = 1 - free, summed from its parts so that it cannot fall below the token share by
        # rounding (the ratio stays <= 1)
        used = token + reserved + internal + external
        if used > 0:
            self._token_state_of_used.append(token / used)
        if num_logical_blocks:
            self._sharing_saving.append(sharing_saving)
        self._num_running.append(num_running)
        self._tokens_held.append(tokens_held)
        if tokens_held:
            if tokens_held > self.kv_tokens_held_max:
                self.kv_tokens_held_max = tokens_held
            self._held_blocks.append(num_allocated_blocks)
            self._held_tokens.append(tokens_held)
        if num_decode_rows:
            self._decode_rows.append(num_decode_rows)
        if attention_version in self.decode_versions:
            self.decode_versions[attention_version] += 1
        if self.num_steps % SPILL_STEPS == 0:
            self._write_spill()

    def _write_spill(self) -> None:
        """Move every column's values so far to the end of the spill file."""
        if self._spill is None:
            self._spill = tempfile.TemporaryFile(prefix="paged-steps-")
        for column, chunks in zip(self._columns, self._chunks):
            if column:
                chunks.append((self._spill.tell(), len(column)))
                column.tofile(self._spill)
                del column[:]

    def _values(self, column: array) -> np.ndarray:
        """All of a column's values in step order: its spilled chunks, then those still held."""
        dtype = np.float64 if column.typecode == "d" else np.int64
        held = np.frombuffer(column, dtype=dtype)
        chunks = self._chunks[next(i for i, c in enumerate(self._columns) if c is column)]
        if not chunks or self._spill is None:
            return held
        out = np.empty(sum(count for _, count in chunks) + len(held), dtype=dtype)
        start = 0
        for offset, count in chunks:
            self._spill.seek(offset)
            out[start:start + count] = np.frombuffer(self._spill.read(count * held.itemsize), dtype=dtype)
            start += count
        out[start:] = held
        self._spill.seek(0, 2)  # back to the end, where the next spill goes
        return out

    def summary(self, bytes_per_block: int | None) -> dict[str, Any]:
        """summary.json's step keys (`MetricsRecorder.summary` places them)."""
        mean = self._column_mean
        bytes_per_token = None
        held_tokens = self._values(self._held_tokens)
        if bytes_per_block is not None and len(held_tokens):
            # as Python's int / int per step: both exact in a float64 (below 2**53), one correctly
            # rounded division
            held_bytes = self._values(self._held_blocks) * bytes_per_block
            if held_bytes.max() >= 2**53:
                raise OverflowError(f"{held_bytes.max()} KV bytes held: past float64's exact integers")
            bytes_per_token = _mean(held_bytes / held_tokens)
        del held_tokens
        token_state = mean(self._token_state)
        return {
            "computed_tokens": self.computed_tokens,
            "kv_usage_mean": mean(self._kv_usage) or 0.0,
            "kv_usage_max": self.kv_usage_max,
            "token_state_fraction_mean": 1.0 if token_state is None else token_state,
            **{f"{key}_mean": mean(column) for key, column in self._breakdown.items()},
            "kv_token_state_of_used_mean": mean(self._token_state_of_used),
            "kv_sharing_saving_mean": mean(self._sharing_saving) or 0.0,
            "num_running_mean": mean(self._num_running),
            "kv_tokens_held_mean": mean(self._tokens_held),
            "kv_tokens_held_max": self.kv_tokens_held_max,
            "kv_bytes_per_token_mean": bytes_per_token,
            "num_engine_steps": self.num_steps,
            "mean_decode_batch_size": _mean(self._values(self._decode_rows).astype(np.float64)),
            "engine_overhead_fraction": self.overhead_s / self.step_time_s if self.step_time_s > 0 else 0.0,
            **{f"decode_steps_{v}": n for v, n in self.decode_versions.items()},
        }


    def _column_mean(self, column: array) -> float | None:
        """np.mean of a column's values, read back one column at a time."""
        return _mean(self._values(column))


def record_step(s: StepRecord) -> tuple[Any, ...]:
    """A step's record as `StepStats.count` takes it (what `add` counts, or a fleet holds)."""
    return (
        s.num_computed_tokens, s.step_time_s, s.overhead_s, s.num_scheduled_tokens - s.num_decode_rows,
        s.num_sampled_tokens, s.time_s, s.kv_usage,
        (s.kv_token_state_fraction, s.kv_reserved_fraction, s.kv_internal_frag_fraction,
         s.kv_external_frag_fraction, s.kv_free_fraction),
        s.num_allocated_blocks, s.token_state_fraction, s.num_logical_blocks, s.kv_sharing_saving,
        s.num_running, s.kv_tokens_held, s.num_decode_rows, s.attention_version,
    )


class DecodeKV:
    """What `decode_step` reads of the cache (a window's, between two of its block edges): one
    group's block counts, its divisions that do not depend on the slots done once, so that a step
    costs the three that do."""

    __slots__ = ("num_free_blocks", "_total", "_usage", "_allocated", "_unplaced", "_unassigned", "_free",
                 "_held_slots", "_logical", "_saving")

    def __init__(self, block_size: int, total_blocks: int, free: int, unassigned: int, stranded: int,
                 logical: int) -> None:
        """`KVStats`' fields of those names (allocated = total - free, as `BlockManager.stats`)."""
        bs, allocated = block_size, total_blocks - free
        total = total_blocks * bs
        self.num_free_blocks = free
        self._total, self._usage, self._allocated = total, allocated / total_blocks, allocated
        self._unplaced = (allocated - unassigned) * bs  # slots of assigned blocks: used, reserved or internal
        self._unassigned = (unassigned + stranded) * bs / total
        self._free = (free - stranded) * bs / total
        self._held_slots = allocated * bs
        # `KVStats.sharing_saving`
        self._logical = logical
        self._saving = 1.0 - (allocated - unassigned) / logical if logical else 0.0

    @classmethod
    def of(cls, kv: KVStats) -> DecodeKV:
        assert kv.num_allocated_blocks == kv.num_total_blocks - kv.num_free_blocks
        return cls(kv.block_size, kv.num_total_blocks, kv.num_free_blocks, kv.num_unassigned_blocks,
                   kv.num_stranded_free_blocks, kv.num_logical_blocks)

    def step(self, num_rows: int, model_time_s: float, attention_version: str | None, used: int, reserved: int,
             start: float, end: float) -> tuple[Any, ...]:
        """`decode_step` of this cache with `used` and `reserved` slots."""
        total = self._total
        shares = (used / total, reserved / total, (self._unplaced - used - reserved) / total, self._unassigned,
                  self._free)
        return (
            num_rows, end - start, max(0.0, end - start - model_time_s), 0, num_rows, end, self._usage, shares,
            self._allocated, used / self._held_slots if self._allocated else 1.0, self._logical, self._saving,
            num_rows, used, num_rows, attention_version,
        )


def decode_step(num_rows: int, model_time_s: float, attention_version: str | None, kv: KVStats, used: int,
                reserved: int, start: float, end: float) -> tuple[Any, ...]:
    """A step of `num_rows` decode rows only (fast-forward's) as `StepStats.count` takes it, as `add`
    would read it from its record: the cache is `kv`'s blocks (one KV group) with `used` and
    `reserved` slots (`KVStats`' values with the same integer operations and one division each)."""
    return DecodeKV.of(kv).step(num_rows, model_time_s, attention_version, used, reserved, start, end)
