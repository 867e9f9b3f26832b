"""The tokens of a step launched under async scheduling, on their way to the host (`PendingOutput`).

One token per sampling row is chosen on the device; on CUDA it is copied into page-locked host
memory without waiting, and an event marks the copy's end, so the host waits for that copy when it
reads the tokens a step later, not for the step it launched since (vLLM V1's async output copy).
On a CPU the tensor is read as it is.
"""

from __future__ import annotations

import dataclasses

import torch

from paged.executor.pending import PendingOutput
from paged.step import ExecutorOutput


class DeviceTokens(PendingOutput):
    """`tokens`: one per sampling row, in batch order; `samples`: per scheduled row, whether it
    samples; `shell`: the step's output without its tokens (counts, times, kernel)."""

    lags = True

    def __init__(self, tokens: torch.Tensor, samples: list[bool], shell: ExecutorOutput) -> None:
        self._samples, self._shell = samples, shell
        self._copied: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = tokens

    def result(self) -> ExecutorOutput:
        if self._copied is not None:
            self._copied.synchronize()
        drawn = iter(self._host.tolist())
        sampled = [[next(drawn)] if samples else [] for samples in self._samples]
        return dataclasses.replace(self._shell, sampled=sampled, logprobs=None, top_logprobs=None)
