"""Hypothesis's example budget: each property's full count in `make test` (and CI), a quarter of it
(at least 10) in `make test-fast`, the edit loop, which sets PAGED_FAST_TESTS=1: the same properties
on fewer examples, so an edit learns of most breaks in seconds and CI still searches as deep."""

from __future__ import annotations

import os

FAST = os.environ.get("PAGED_FAST_TESTS") == "1"


def examples(full: int) -> int:
    """The number of examples for a property whose full budget is `full`."""
    return max(min(full, 10), full // 4) if FAST else full
