"""Does `snapkv` keep what SnapKV keeps? An independent reference on SmolLM2-135M's own queries and keys.

For the needle prompts of `kv_press_quality.py` (a "magic number" sentence at a depth of public text,
the question last), the prompt is computed once with the full cache, recording each layer's queries
and keys (RoPE applied) of the prompt. Then:

- the mass check: the scores `kv_press_quality.py` hands `snapkv` (summed over heads, averaged over
  layers, as the engine's `StepScores`) against a float64 recomputation from the recorded q/k;
- SnapKV as the paper and NVIDIA kvpress's `SnapKVPress` define it: per layer and per KV head, the
  softmax of the last `--queries` queries over every key (causal), the columns before the window
  averaged over those queries, avg-pooled over `--kernel` tokens (torch's avg_pool1d, zero padded),
  averaged over the group's query heads; each (layer, KV head) keeps its own top tokens, as many as
  the budget leaves after the recent window (the window is the observation window);
- `one set (reference)`: the same per-head scores averaged over layers and heads, one top-k: what our
  single keep set would be with kvpress's scoring details (separates those from the granularity);
- `ours`: `SnapKVPress.keep` on the view, one keep set for every layer and head.

For each it reports the share of the needle sentence's tokens kept (per head: the mean over the
layer x KV head sets, and in how many sets the whole number is kept) and whether greedy decoding
with those keep sets (per-head ones by masking keys) still answers the number.

    PYTHONPATH=$PWD .venv/bin/python experiments/kv_press_reference.py --lengths 1024 2048 \
        --out experiments/results/kv-press-quality-8k/snapkv-reference.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from kv_press_quality import NEEDLE, QUESTION, DenseAttention, make_press, read_text

from paged.config import compose_config
from paged.engine.builder import build_executor


class RecordingAttention(DenseAttention):
    """DenseAttention that also keeps each layer's queries of the prompt (fp32, RoPE applied)."""

    def __init__(self, scale: float, last_queries: int) -> None:
        super().__init__(scale, last_queries)
        self.queries: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self.queries[layer] = q[-self.last_queries :].float().clone()
        return super().__call__(layer, q, k, v)


class MaskedAttention:
    """Dense float32 attention in which each (layer, KV head) sees only its kept keys (`masks[layer]`:
    bool [Hk, n]); tokens appended after the prompt are seen by every head."""

    def __init__(self, full: DenseAttention, masks: dict[int, torch.Tensor]) -> None:
        self.scale = full.scale
        self.keys = dict(full.keys)
        self.values = dict(full.values)
        self.masks = dict(masks)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self.keys[layer] = torch.cat([self.keys[layer], k.float()])
        values = self.values[layer] = torch.cat([self.values[layer], v.float()])
        hk = keys.shape[1]
        mask = self.masks[layer] = torch.cat([self.masks[layer], torch.ones(hk, k.shape[0], dtype=torch.bool)], 1)
        assert q.shape[0] == 1, "decode only"
        group = q.shape[1] // hk
        qs = q.float().view(hk, group, -1)
        logits = torch.matmul(qs, keys.permute(1, 2, 0)) * self.scale  # [Hk, G, n]
        logits.masked_fill_(~mask[:, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(logits, dim=-1), values.transpose(0, 1))  # [Hk, G, D]
        return out.reshape(1, q.shape[1], -1).to(q.dtype)


def window_softmax(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 [Hk, G, w, n]: the last w queries' causal softmax over all n keys."""
    w, n, hk = q.shape[0], k.shape[0], k.shape[1]
    qs = q.double().view(w, hk, -1, q.shape[-1]).permute(1, 2, 0, 3)  # [Hk, G, w, D]
    logits = torch.matmul(qs, k.double().permute(1, 2, 0)[:, None]) * scale  # [Hk, G, w, n]
    future = torch.arange(n)[None, :] > (n - w + torch.arange(w))[:, None]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def reference_scores(attn: RecordingAttention, window: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass as the engine defines it, [n]; kvpress SnapKV scores of the prefix, [L, Hk, n - window])."""
    mass, per_head = [], []
    for layer in sorted(attn.queries):
        weights = window_softmax(attn.queries[layer], attn.keys[layer], attn.scale)
        mass.append(weights.sum(dim=(0, 1, 2)))
        prefix = weights[..., : weights.shape[-1] - window].mean(dim=2)  # [Hk, G, n - window]
        hk, g, m = prefix.shape
        pooled = F.avg_pool1d(prefix.reshape(hk * g, 1, m), kernel, stride=1, padding=kernel // 2).view(hk, g, m)
        per_head.append(pooled.mean(dim=1))
    return torch.stack(mass).mean(dim=0), torch.stack(per_head)


def greedy_answer(model: Any, attn: Any, first: torch.Tensor, length: int, count: int) -> list[int]:
    tokens = [int(first.argmax())]
    with torch.inference_mode():
        for i in range(1, count):
            hidden = model.forward(torch.tensor(tokens[-1:]), torch.tensor([length + i - 1]), attn)
            tokens.append(int(model.compute_logits(hidden)[0].argmax()))
    return tokens


def cell(args: argparse.Namespace, ex: Any, tokens: list[int], length: int, depth: float) -> dict[str, Any]:
    tokenizer, model = ex.tokenizer, ex.model
    number = str(10000 + (length * 7 + int(depth * 100) * 13) % 89999)
    needle = tokenizer.encode(NEEDLE.format(number, number))
    question = tokenizer.encode(QUESTION)
    hay = tokens[: length - len(needle) - len(question)]
    at = int(depth * len(hay))
    prompt = hay[:at] + needle + hay[at:] + question
    n = len(prompt)
    needle_span = np.arange(at, at + len(needle))
    # the first number's tokens: those the answer must copy
    head = len(tokenizer.encode(NEEDLE.split("{}")[0]))
    digits = np.arange(at + head, at + head + len(tokenizer.encode(number)))

    attn = RecordingAttention(ex.scale, args.queries)
    attn.recording = True
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(prompt), torch.arange(n), attn)
    attn.recording = False
    first = model.compute_logits(hidden[-1:])[0]
    press = make_press("snapkv", args.ratio, args.window, args.queries)
    view = attn.view(press)
    mass, per_head = reference_scores(attn, args.window, args.kernel)
    mass_error = float((torch.from_numpy(view.scores).double() - mass).abs().max() / mass.abs().max())

    budget = press.budget(n)
    room = budget - args.window
    recent = np.arange(n - args.window, n)
    ours = press.keep(view)
    assert ours is not None
    head_sets = per_head.topk(room, dim=-1).indices.numpy()  # [L, Hk, room]
    one_ref = np.concatenate([np.sort(per_head.mean(dim=(0, 1)).topk(room).indices.numpy()), recent])
    layers, hk = head_sets.shape[:2]
    masks = {}
    for layer in range(layers):
        mask = torch.zeros(hk, n, dtype=torch.bool)
        for h in range(hk):
            mask[h, head_sets[layer, h]] = True
        mask[:, recent] = True
        masks[layer] = mask

    def kept_share(kept: np.ndarray) -> float:
        return float(np.isin(needle_span, kept).mean())

    per_head_share = float(np.mean([np.isin(needle_span, s).mean() for s in head_sets.reshape(-1, room)]))
    heads_with_number = int(sum(np.isin(digits, s).all() for s in head_sets.reshape(-1, room)))
    ours_old = ours[ours < n - args.window]
    overlap = float(np.mean([np.isin(s, ours_old).mean() for s in head_sets.reshape(-1, room)]))

    def answer(attention: Any) -> tuple[str, bool]:
        text = tokenizer.decode(greedy_answer(model, attention, first, n, 6))
        return text, number in text

    results = {"length": n, "depth": depth, "budget": budget, "mass_rel_error": mass_error,
               "head_sets_with_number": f"{heads_with_number}/{layers * hk}",
               "overlap_ours_with_head_sets": overlap,
               "overlap_ours_with_one_set_reference": float(np.isin(one_ref, ours).mean())}
    for name, share, attention in (
        ("full", 1.0, attn.keeping(np.arange(n))),
        ("ours", kept_share(ours), attn.keeping(ours)),
        ("one set (reference)", kept_share(one_ref), attn.keeping(one_ref)),
        ("per layer x KV head (reference)", per_head_share, MaskedAttention(attn, masks)),
    ):
        text, hit = answer(attention)
        results[name] = {"needle_kept": share, "answer": text, "hit": hit}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    assert args.queries == args.window, "SnapKV's observation window is the recent window it keeps"
    start = time.perf_counter()
    ex = build_executor(compose_config(["model=smollm2-135m", "logger=none", "progress=false",
                                        "allocator.num_blocks=16", "kernel.backend=torch"]))
    tokens = ex.tokenizer.encode(read_text([]))
    rows = []
    for length in args.lengths:
        for depth in args.depths:
            row = cell(args, ex, tokens, length, depth)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{time.perf_counter() - start:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cells": rows}, indent=1))


if __name__ == "__main__":
    main()
