"""The model executor's side of async scheduling (`scheduler.async_scheduling`,
`paged.engine.async_step`): a step launched with its sampled tokens left on the device.

The tokens go to `sampled_ids`, a buffer at a fixed address (CUDA graphs read it), where the next
step's placeholder ids read them (`ModelExecutor._forward`), and to the host by a non-blocking copy
(`DeviceTokens`), read a step later. A step holding a request whose tokens cannot lag
(`paged.step.tokens_can_lag`) runs to its end instead."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

import torch

from paged.executor.device_tokens import DeviceTokens
from paged.executor.pending import PendingOutput, ReadyOutput
from paged.executor.step_sampling import sample_on_device
from paged.step import ExecutorOutput, SchedulerOutput, tokens_can_lag


class LaunchAhead:
    """`ModelExecutor`'s `launch` (a mixin: the executor sets the state it reads)."""

    supports_async_scheduling = True
    sampled_ids: torch.Tensor | None  # None: async scheduling off
    model: Any
    seed: int
    eos_token_ids: Collection[int]
    # and `execute`, `_compute` and `_count_tokens`, the executor's own

    @classmethod
    def async_scheduling_refusal(cls, settings: Mapping[str, Any]) -> str | None:
        size = settings.get("tensor_parallel_size", 1)
        if size != 1:
            return (f"does not run with executor.tensor_parallel_size={size}: the worker ranks build a step's "
                    "inputs from token ids the host holds")
        return None

    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """Under async scheduling, a step whose every request's tokens can lag leaves them on the
        device, in `sampled_ids` and on their way to the host; any other step runs to its end."""
        if self.sampled_ids is None or sched.is_empty or not all(
            tokens_can_lag(it.seq.request.params) for it in sched.scheduled
        ):
            return ReadyOutput(self.execute(sched))
        start = time.perf_counter()
        ran = self._compute(sched)
        assert ran is not None, "a step with scheduled rows computes them"
        host, version, hidden, batch, prep_time = ran
        with torch.inference_mode():
            tokens = sample_on_device(self.model, sched, hidden, batch, self.seed, self.eos_token_ids)
            self.sampled_ids[: tokens.shape[0]] = tokens
        self._count_tokens(host)
        shell = ExecutorOutput([], host.num_tokens, time.perf_counter() - start - prep_time, prep_time, version)
        return DeviceTokens(tokens, [it.num_samples > 0 for it in sched.scheduled], shell)
