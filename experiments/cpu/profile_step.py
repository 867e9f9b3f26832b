"""Where a real-model step's time goes on this CPU: the breakdown issue 15's optimisations start from.

Runs bench_throughput.py's requests (prompts 32-512, outputs 16-256, greedy, ignore_eos) through
`LLM("smollm2-135m")` with every component of a step timed by wall clock (the CPU path is
synchronous, so a call's wall time is its cost): matmuls (the layers' linears, and the lm_head
apart), attention (prefill and decode calls apart), the KV cache write, norms/RoPE/SwiGLU (torch
formulas or the native fused ops), sampling, and input preparation. What no component claims is
Python and framework overhead between the calls, also shown per layer call. Prefill steps (any
prompt token) and decode-only steps are reported apart. A decode step whose layers run in one native
call (`model.native_decode`, paged.model.decode_layers) is one component, "decode layers (one native
call)": `--overrides model.native_decode=false` splits it into the others.

    python experiments/cpu/profile_step.py [--num-requests 64] [--overrides model.gemm=torch ...]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import paged.executor.model_executor as model_executor
import paged.executor.step_sampling as step_sampling
import paged.kernels.planned as planned
from paged import LLM, SamplingParams
from paged.executor.step_plan import InputBuffers
from paged.model.decode_layers import DecodeLayers
from paged.model.layer_ops import NATIVE_CPU_OPS, TORCH_OPS, RunnerLayerOps, TorchLayerOps
from paged.model.linear import Linear
from paged.model.llama import LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import make_requests  # noqa: E402  (sibling script, not a package)

CATEGORIES = [
    "matmul (layers)", "matmul (lm_head)", "attention (prefill)", "attention (decode)", "KV cache write",
    "norms / RoPE / SwiGLU", "decode layers (one native call)", "sampling", "input preparation",
    "Python and framework overhead",
]


class StepTimer:
    """Seconds per category, accumulated into the current step's kind (prefill or decode)."""

    def __init__(self) -> None:
        self.kind = "decode"
        self.seconds: dict[str, dict[str, float]] = {"prefill": defaultdict(float), "decode": defaultdict(float)}
        self.steps = {"prefill": 0, "decode": 0}
        self.depth = 0  # only the outermost timed call counts (the lm_head is a Linear inside sampling's caller)

    def wrap(self, category: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                name = category(*args) if callable(category) else category
                self.seconds[self.kind][name] += time.perf_counter() - start
        return timed


def instrument(timer: StepTimer) -> None:
    """Wrap every component where the executor looks it up (module attributes and methods)."""
    for cls, category in ((planned.DecodeAttention, "attention (decode)"),
                          (planned.PrefillAttention, "attention (prefill)"), (planned.CacheWrite, "KV cache write")):
        cls.__call__ = timer.wrap(category, cls.__call__)
    step_sampling.sample = timer.wrap("sampling", step_sampling.sample)
    model_executor.plan_batch = timer.wrap("input preparation", model_executor.plan_batch)
    InputBuffers.upload = timer.wrap("input preparation", InputBuffers.upload)
    Linear.__call__ = timer.wrap("matmul (layers)", Linear.__call__)
    DecodeLayers.run = timer.wrap("decode layers (one native call)", DecodeLayers.run)
    LlamaModel.compute_logits = timer.wrap("matmul (lm_head)", LlamaModel.compute_logits)
    for cls in {type(ops) for ops in (NATIVE_CPU_OPS, TORCH_OPS)} | {TorchLayerOps, RunnerLayerOps}:
        for method in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotation", "rope"):
            setattr(cls, method, timer.wrap("norms / RoPE / SwiGLU", cls.__dict__.get(method, getattr(cls, method))))
    execute = model_executor.ModelExecutor.execute

    def timed_execute(self: Any, sched: Any) -> Any:
        timer.kind = "prefill" if any(not it.is_decode for it in sched.scheduled) else "decode"
        timer.steps[timer.kind] += 1
        start = time.perf_counter()
        out = execute(self, sched)
        timer.seconds[timer.kind]["step"] += time.perf_counter() - start
        return out

    model_executor.ModelExecutor.execute = timed_execute


def report(console: Console, timer: StepTimer, num_layers: int, title: str) -> None:
    table = Table(title=title)
    for col in ("component", "prefill s", "prefill %", "decode s", "decode %", "all %"):
        table.add_column(col, justify="left" if col == "component" else "right")
    totals = {k: timer.seconds[k]["step"] for k in ("prefill", "decode")}
    for kind in ("prefill", "decode"):
        claimed = sum(v for name, v in timer.seconds[kind].items() if name != "step")
        timer.seconds[kind]["Python and framework overhead"] = totals[kind] - claimed
    everything = sum(totals.values())
    for name in CATEGORIES:
        p, d = timer.seconds["prefill"][name], timer.seconds["decode"][name]
        table.add_row(name, f"{p:.2f}", f"{100 * p / max(totals['prefill'], 1e-9):.1f}", f"{d:.2f}",
                      f"{100 * d / max(totals['decode'], 1e-9):.1f}", f"{100 * (p + d) / everything:.1f}")
    table.add_row("step total", f"{totals['prefill']:.2f}", "100", f"{totals['decode']:.2f}", "100", "100")
    console.print(table)
    for kind in ("prefill", "decode"):
        steps = timer.steps[kind]
        if steps:
            overhead = timer.seconds[kind]["Python and framework overhead"]
            console.print(f"{kind}: {steps} steps, {1000 * totals[kind] / steps:.1f} ms per step; overhead "
                          f"{1e6 * overhead / (steps * num_layers):.0f} µs per layer call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides for the LLM")
    args = ap.parse_args()
    timer = StepTimer()
    instrument(timer)
    llm = LLM("smollm2-135m", overrides=["scheduler.max_num_seqs=64", *args.overrides])
    corpus = llm.executor.tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    prompts, outputs = make_requests(args.num_requests, args.seed, corpus)
    timer.seconds = {"prefill": defaultdict(float), "decode": defaultdict(float)}  # drop what loading ran
    timer.steps = {"prefill": 0, "decode": 0}
    start = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outputs],
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    console = Console()
    report(console, timer, llm.executor.arch.num_layers,
           f"{args.num_requests} requests in {elapsed:.1f} s ({sum(outputs) / elapsed:.1f} output tok/s); "
           f"{llm.executor.description}")


if __name__ == "__main__":
    main()
