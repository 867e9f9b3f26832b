"""Checks of a step's rows on their host copies: what the front-end ops read from tensors on every
call (and so wait on the device for), checked once per step by a planned op (`paged.kernels.planned`)
before anything is copied to the device.
"""

from __future__ import annotations

import numpy as np


def check_rows(
    block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray, *, num_tokens: int,
    block_size: int, num_blocks: int, max_seq_len: int,
) -> None:
    """The values of one op's rows, on their host copies, once per step: what the per-call checks
    read from tensors, plus that every block a row reads is a block of the cache."""
    num_seqs = seq_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"rows disagree: block_tables {block_tables.shape}, seq_lens {seq_lens.shape}, "
                         f"query_start_loc {query_start_loc.shape}")
    check_offsets(query_start_loc, seq_lens, num_tokens)
    longest = int(seq_lens.max()) if num_seqs else 0
    if longest > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is below the longest sequence ({longest})")
    check_covers(block_tables.shape[1], block_size, max_seq_len)
    # every entry a block of the cache (the padding is 0): the usual step, two reductions
    if not block_tables.size or (block_tables.min() >= 0 and block_tables.max() < num_blocks):
        return
    read = np.arange(block_tables.shape[1]) < -(-seq_lens[:, None] // block_size)
    bad = read & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        raise ValueError(f"block_tables name block(s) {sorted(set(block_tables[bad].tolist()))} outside the "
                         f"cache's {num_blocks} blocks")


def check_offsets(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_tokens: int) -> None:
    """Query offsets that rise from 0 to `num_tokens`, no sequence with more queries than context."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # np.diff's, without its Python wrapper
    if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens or (q_lens < 0).any():
        raise ValueError(f"query_start_loc must rise from 0 to num_tokens={num_tokens}, got {query_start_loc.tolist()}")
    if (q_lens > seq_lens).any():
        raise ValueError(f"a sequence has more queries than context: query lengths {q_lens.tolist()}, "
                         f"seq_lens {seq_lens.tolist()}")


def check_covers(columns: int, block_size: int, max_seq_len: int) -> None:
    """Block tables of `columns` blocks reach `max_seq_len`, the length the kernels read up to."""
    if columns * block_size < max_seq_len:
        raise ValueError(f"block_tables has {columns} columns of {block_size} tokens, "
                         f"fewer than max_seq_len={max_seq_len} needs")


def check_slots(slot_mapping: np.ndarray, num_slots: int) -> bool:
    """A step's slot mapping, on its host copy: a slot of the cache, or -1 (skipped); whether any
    is -1 (a padding row, which the cache write must skip)."""
    if not slot_mapping.size:
        return False
    lowest = slot_mapping.min()
    if lowest < -1 or slot_mapping.max() >= num_slots:
        bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
        raise ValueError(f"slot_mapping holds {sorted(set(slot_mapping[bad].tolist()))}; slots run from 0 to "
                         f"{num_slots - 1} (-1: skip)")
    return bool(lowest < 0)
