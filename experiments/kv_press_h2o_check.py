"""Why `h2o` lost 22% perplexity at 2x: its mass checked against float64, and its budget split varied.

On one input of public text (SmolLM2-135M, the prompt computed once with the full cache), the
accumulated mass `kv_press_quality.py` hands `h2o` (every prompt query's softmax, summed over heads,
averaged over layers, as the engine's `StepScores`) is compared with a float64 recomputation from
the recorded queries and keys. Then, at each ratio, perplexity of the held-out continuation and
greedy agreement with the full cache for:

- `h2o window only`: `recent_share` 0, the recent `--window` and heavy hitters (the press before);
- `h2o half recent`: `recent_share` 0.5, H2O's split of its budget (the press now);
- `observed, window only`: NVIDIA kvpress's ObservedAttentionPress (H2O-related): the mass divided
  by the number of queries that saw each token, so that early tokens are not favoured for being
  seen by more queries;
- `sink-window` for comparison.

    PYTHONPATH=$PWD .venv/bin/python experiments/kv_press_h2o_check.py --length 2048 \
        --out experiments/results/kv-press-quality-8k/h2o-check.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from kv_press_quality import continuation_nll, greedy, read_text
from kv_press_reference import RecordingAttention

from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.memory.press import H2OPress, PressView, SinkWindowPress


def float64_mass(attn: RecordingAttention, chunk: int = 256) -> torch.Tensor:
    """Every recorded query's causal softmax over the keys, summed over queries and heads, mean over layers."""
    total = []
    for layer in sorted(attn.queries):
        q, k = attn.queries[layer].double(), attn.keys[layer].double()
        n, hk = k.shape[0], k.shape[1]
        mass = torch.zeros(n, dtype=torch.float64)
        for start in range(0, n, chunk):
            qs = q[start : start + chunk]
            c = qs.shape[0]
            qs = qs.view(c, hk, -1, qs.shape[-1]).permute(1, 2, 0, 3)  # [Hk, G, c, D]
            logits = torch.matmul(qs, k.permute(1, 2, 0)[:, None]) * attn.scale
            future = torch.arange(n)[None, :] > (start + torch.arange(c))[:, None]
            mass += torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).sum(dim=(0, 1, 2))
        total.append(mass)
    return torch.stack(total).mean(dim=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--generate", type=int, default=16)
    parser.add_argument("--ratios", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    ex = build_executor(compose_config(["model=smollm2-135m", "logger=none", "progress=false",
                                        "allocator.num_blocks=16", "kernel.backend=torch"]))
    tokens = ex.tokenizer.encode(read_text([]))
    context, continuation = tokens[: args.length], tokens[args.length : args.length + args.continuation]
    n = len(context)
    attn = RecordingAttention(ex.scale, n)  # every prompt query recorded
    attn.recording = True
    with torch.inference_mode():
        hidden = ex.model.forward(torch.tensor(context), torch.arange(n), attn)
    attn.recording = False
    first = ex.model.compute_logits(hidden[-1:])[0]
    view = attn.view(H2OPress(ratio=2))
    assert view.scores is not None
    reference = float64_mass(attn)
    error = float((torch.from_numpy(view.scores).double() - reference).abs().max() / reference.abs().max())
    observers = (n - np.arange(n)).astype(np.float32)  # queries at positions >= i saw token i
    observed = PressView(view.positions, n, view.block_size, scores=view.scores / observers)
    everything = np.arange(n)
    base = continuation_nll(ex.model, attn.keeping(everything), first, n, continuation)
    reference_tokens = greedy(ex.model, attn.keeping(everything), first, n, args.generate)
    rows = []
    for ratio in args.ratios:
        variants = {
            "h2o window only": H2OPress(recent_share=0, ratio=ratio, window=args.window).keep(view),
            "h2o half recent": H2OPress(recent_share=0.5, ratio=ratio, window=args.window).keep(view),
            "observed, window only": H2OPress(recent_share=0, ratio=ratio, window=args.window).keep(observed),
            "sink-window": SinkWindowPress(ratio=ratio, window=args.window).keep(view),
        }
        for name, kept in variants.items():
            assert kept is not None
            nll = continuation_nll(ex.model, attn.keeping(kept), first, n, continuation)
            out = greedy(ex.model, attn.keeping(kept), first, n, args.generate)
            row = {"ratio": ratio, "variant": name, "kept": int(kept.shape[0]),
                   "kept_before_half": int((kept < n // 2).sum()), "ppl": math.exp(nll),
                   "vs_full": math.exp(nll - base) - 1, "agreement": float(np.mean(np.array(out) == reference_tokens))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"length": n, "full_ppl": math.exp(base), "mass_rel_error": error,
               "seconds": time.perf_counter() - start, "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
