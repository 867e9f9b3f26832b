"""How much of a decode forward runs inside the native entry points (issue 47, the native decode layers).

Every `*_cpu` entry point of the cpu library is wrapped by a timer that counts only while a decode forward
(at most 32 rows) of `LlamaModel.forward` runs; 32 requests of 100 tokens then decode 64 tokens each. The
forward's time outside the entry points is the Python between them. With `model.native_decode=true` (the
default) a decode forward is one entry point, `decode_layers_cpu`, which makes the others' calls itself.

    python experiments/results/bench-vs-vllm/issue47-native-decode/native_share.py bfloat16|float32 \
        [model.native_decode=false]
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from typing import Any

import paged  # noqa: F401  (first: its thread settings must precede torch's OpenMP runtime)
from paged import LLM, SamplingParams
from paged.kernels.backends import cpu as native
from paged.model.llama import LlamaModel

ROWS = 32


def main() -> None:
    dtype, overrides = sys.argv[1], sys.argv[2:]
    lib = native.load()
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    timing = {"on": False, "forward": 0.0, "forwards": 0}

    def timed(name: str) -> None:
        entry = getattr(lib, name)

        def run(*args: Any) -> int:
            if not timing["on"]:
                return entry(*args)
            start = time.perf_counter()
            status = entry(*args)
            seconds[name] += time.perf_counter() - start
            calls[name] += 1
            return status

        setattr(lib, name, run)

    symbols = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True,
                             check=True).stdout.split()
    for name in symbols:
        if name.endswith("_cpu") and not name.startswith("_") and hasattr(lib, name):
            timed(name)
    llm = LLM("smollm2-135m", overrides=[f"model.dtype={dtype}", *overrides])  # entry points bound after the wraps
    forward = LlamaModel.forward

    def timed_forward(model: LlamaModel, input_ids: Any, positions: Any, *args: Any) -> Any:
        if input_ids.shape[0] > ROWS:
            return forward(model, input_ids, positions, *args)
        timing["on"] = True
        start = time.perf_counter()
        try:
            return forward(model, input_ids, positions, *args)
        finally:
            timing["forward"] += time.perf_counter() - start
            timing["forwards"] += 1
            timing["on"] = False

    LlamaModel.forward = timed_forward
    llm.generate(["hi"], [SamplingParams(max_tokens=4)], use_tqdm=False)
    seconds.clear()
    calls.clear()
    timing.update(forward=0.0, forwards=0)
    llm.generate(["word " * 100] * ROWS, [SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)] * ROWS,
                 use_tqdm=False)
    n, inside = timing["forwards"], sum(seconds.values())
    print(f"{dtype} {' '.join(overrides)}: {n} decode forwards, {timing['forward'] / n * 1e3:.2f} ms each; inside "
          f"the entry points {inside / n * 1e3:.2f} ms ({100 * inside / timing['forward']:.1f}%), outside "
          f"{(timing['forward'] - inside) / n * 1e3:.2f} ms")
    for name, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {name:28s} {spent / n * 1e3:7.3f} ms a forward, {calls[name] / n:4.0f} calls, "
              f"{spent / calls[name] * 1e6:7.1f} us a call")


if __name__ == "__main__":
    main()
