"""`paged.kernels.greedy.argmax_rows`: the native cpu argmax returns torch.argmax's indices (the first
largest value, the first NaN of a row that holds one, -0 equal to +0), and torch serves what it
does not."""

from __future__ import annotations

import pytest
import torch

from paged.kernels import fused_ops
from paged.kernels.greedy import argmax_rows

pytestmark = pytest.mark.skipif(fused_ops.unavailable_reason() is not None, reason="no native cpu library")


def _logits(kind: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, cols, generator=gen)
    if kind == "ties":  # a handful of values: the largest repeats in most rows
        return torch.randint(-3, 3, (rows, cols), generator=gen).float()
    if kind == "nan":
        x = torch.randn(rows, cols, generator=gen)
        x[torch.rand(rows, cols, generator=gen) < 0.01] = float("nan")
        return x
    x = torch.full((rows, cols), float("-inf"))  # "zeros": -0 and +0 the largest, or nothing above -inf
    x[torch.rand(rows, cols, generator=gen) < 0.05] = -0.0
    x[torch.rand(rows, cols, generator=gen) < 0.05] = 0.0
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "zeros"])
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (1, 17), (3, 63), (5, 64), (7, 1000), (32, 49152), (40, 2049)])
def test_argmax_rows_returns_torchs_indices(kind: str, rows: int, cols: int) -> None:
    x = _logits(kind, rows, cols, torch.Generator().manual_seed(rows * 7919 + cols))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1, keepdim=True))


def test_rows_of_a_wider_tensor_and_what_torch_serves() -> None:
    x = torch.randn(9, 3000, generator=torch.Generator().manual_seed(3))
    for view in (x[:, :2500], x[::2], x.t().contiguous().t()[:, :100], x.to(torch.bfloat16), torch.empty(4, 0)):
        if view.numel() == 0:
            with pytest.raises(IndexError):  # torch's own refusal of an empty vocabulary
                argmax_rows(view)
            continue
        assert torch.equal(argmax_rows(view), view.argmax(dim=-1, keepdim=True))
