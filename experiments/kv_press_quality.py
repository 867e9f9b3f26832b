"""What KV compression costs in quality: the real SmolLM2-135M on this CPU, each press at 2x, 4x, 8x.

For each long input (`--length` tokens of public text: `--samples` stretches evenly spaced through
paged/data/corpus.txt and the GNU/Apache licence texts under /usr/share/common-licenses, or through
`--text` files; or, with `--input FILE...` given once per input, the start of each group of files,
so that inputs can be different texts), the prompt is computed once with
the full cache; each press then judges it as the engine does after a prompt (`kv_press.interval=0`:
one `PressView` of the held tokens, their key/value norms and attention mass averaged over layers),
and the model goes on attending only to the kept tokens, at their original positions:

- perplexity of the held-out continuation (the next `--continuation` tokens, teacher-forced),
- greedy agreement with the full cache: the share of `--generate` greedy tokens equal, position by
  position, to the full cache's,
- a needle-in-a-haystack sweep (`--needle-lengths` x `--needle-depths`, at `--needle-ratio`): a
  "magic number" sentence hidden at a depth of the text, the prompt ending with the question; a hit
  is the number among the greedy answer's tokens.

Attention here is dense float32 over exactly the kept tokens: tests/test_kv_press.py shows the
engine's greedy tokens equal such a reference, and tests/test_kv_press_scores.py that the mass the
engine hands a press is this one. Writes results.json, table.md and quality.png to `--out`.

    PYTHONPATH=$PWD .venv/bin/python experiments/kv_press_quality.py --length 1024 --samples 2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.memory.press import PRESSES, KVPress, PressView

LICENCES = ("GPL-3", "GFDL-1.3", "Apache-2.0", "LGPL-3", "MPL-2.0", "Artistic")
BLOCK_SIZE = 16
NEEDLE = " The magic number is {}. Remember it: the magic number is {}."
QUESTION = "\nWhat is the magic number? The magic number is"


class DenseAttention:
    """float32 causal attention over each layer's K/V (RoPE applied), queries in chunks. While
    `recording`, it sums per layer each held token's mass from every query and from the last
    `last_queries`, and its key and value norms (means over KV heads), for the presses' views."""

    def __init__(self, scale: float, last_queries: int, chunk: int = 256) -> None:
        self.scale, self.last_queries, self.chunk = scale, last_queries, chunk
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.recording = False
        self.sums: dict[str, torch.Tensor | float] = {"all": 0.0, "last": 0.0, "knorm": 0.0, "vnorm": 0.0}
        self.num_layers = 0

    def keeping(self, kept: np.ndarray) -> DenseAttention:
        """A copy that holds only the `kept` KV indices (it shares nothing it would append to)."""
        index = torch.from_numpy(kept)
        copy = DenseAttention(self.scale, self.last_queries, self.chunk)
        copy.keys = {layer: k[index] for layer, k in self.keys.items()}
        copy.values = {layer: v[index] for layer, v in self.values.items()}
        return copy

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self.keys[layer] = torch.cat([self.keys[layer], k.float()]) if layer in self.keys else k.float()
        values = self.values[layer] = torch.cat([self.values[layer], v.float()]) if layer in self.values else v.float()
        n, t, kv_heads = keys.shape[0], q.shape[0], keys.shape[1]
        group = q.shape[1] // kv_heads
        out = torch.empty(t, q.shape[1], q.shape[2])
        mass_all, mass_last = torch.zeros(n), torch.zeros(n)
        for start in range(0, t, self.chunk):
            qs = q[start : start + self.chunk].float()
            c = qs.shape[0]
            seen = n - t + start + c  # the chunk's last query sees keys 0 .. seen - 1: later ones are skipped
            qs = qs.view(c, kv_heads, group, -1).permute(1, 2, 0, 3).reshape(kv_heads, group * c, -1)
            logits = torch.matmul(qs, keys[:seen].transpose(0, 1).transpose(1, 2)) * self.scale  # [Hk, G*c, seen]
            query_index = (n - t + start + torch.arange(c)).repeat(group)
            logits.masked_fill_(torch.arange(seen)[None, None, :] > query_index[None, :, None], float("-inf"))
            weights = torch.softmax(logits, dim=-1)
            heads = torch.matmul(weights, values[:seen].transpose(0, 1))  # [Hk, G*c, D]
            out[start : start + c] = heads.view(kv_heads, group, c, -1).permute(2, 0, 1, 3).reshape(c, q.shape[1], -1)
            if self.recording:
                per_query = weights.view(kv_heads, group, c, seen).sum(dim=(0, 1))  # [c, seen]
                mass_all[:seen] += per_query.sum(dim=0)
                mass_last[:seen] += per_query[query_index[:c] >= n - self.last_queries].sum(dim=0)
        if self.recording:
            self.sums["all"] = self.sums["all"] + mass_all
            self.sums["last"] = self.sums["last"] + mass_last
            self.sums["knorm"] = self.sums["knorm"] + keys.norm(dim=-1).mean(dim=1)
            self.sums["vnorm"] = self.sums["vnorm"] + values.norm(dim=-1).mean(dim=1)
            self.num_layers = max(self.num_layers, layer + 1)
        return out.to(q.dtype)

    def view(self, press: KVPress) -> PressView:
        """What the engine shows `press` of the prompt just computed."""
        mean = {name: (value / self.num_layers).numpy() for name, value in self.sums.items()}
        n = mean["all"].shape[0]
        scores = mean["all"] if press.accumulates else mean["last"]
        return PressView(np.arange(n), n, BLOCK_SIZE, mean["knorm"], mean["vnorm"], scores)


@torch.inference_mode()
def prefill(model: Any, ids: list[int], scale: float, last_queries: int) -> tuple[DenseAttention, torch.Tensor]:
    attn = DenseAttention(scale, last_queries)
    attn.recording = True
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), attn)
    attn.recording = False
    return attn, model.compute_logits(hidden[-1:])[0]


@torch.inference_mode()
def continuation_nll(model: Any, attn: DenseAttention, first_logits: torch.Tensor, length: int,
                     continuation: list[int]) -> float:
    """Mean negative log-likelihood of `continuation` after a prompt of `length` tokens."""
    hidden = model.forward(torch.tensor(continuation[:-1]), torch.arange(length, length + len(continuation) - 1), attn)
    logits = torch.cat([first_logits[None], model.compute_logits(hidden)])
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(continuation)))


@torch.inference_mode()
def greedy(model: Any, attn: DenseAttention, first_logits: torch.Tensor, length: int, count: int) -> list[int]:
    tokens = [int(first_logits.argmax())]
    for i in range(1, count):
        hidden = model.forward(torch.tensor(tokens[-1:]), torch.tensor([length + i - 1]), attn)
        tokens.append(int(model.compute_logits(hidden)[0].argmax()))
    return tokens


def make_press(name: str, ratio: float, window: int, queries: int) -> KVPress:
    settings: dict[str, Any] = {"ratio": ratio, "window": window}
    if name == "snapkv":
        settings["queries"] = queries
    return PRESSES[name](**settings)


def read_text(paths: list[str]) -> str:
    """The files' texts joined (the corpus and licences when none are named; a named file must exist)."""
    if not paths:
        corpus = Path(__file__).parents[1] / "paged/data/corpus.txt"
        paths = [str(corpus), *(f"/usr/share/common-licenses/{n}" for n in LICENCES)]
        return "\n\n".join(Path(p).read_text() for p in paths if Path(p).exists())
    return "\n\n".join(Path(p).read_text() for p in paths)


def inputs(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """Each input's `--length` + `--continuation` tokens: one per `--input` group, else `--samples`
    stretches evenly spaced through the text."""
    span = args.length + args.continuation
    if args.input:
        texts = [tokenizer.encode(read_text(group)) for group in args.input]
        short = [(group, len(t)) for group, t in zip(args.input, texts, strict=True) if len(t) < span]
        if short:
            raise SystemExit(f"--input {short[0][0]} has {short[0][1]} tokens; --length + --continuation need {span}")
        return [t[:span] for t in texts]
    tokens = tokenizer.encode(read_text(args.text))
    if len(tokens) < span:
        raise SystemExit(f"--length + --continuation need {span} tokens of text; the text has {len(tokens)}")
    return [tokens[start : start + span] for start in np.linspace(0, len(tokens) - span, args.samples).astype(int)]


def quality(args: argparse.Namespace, model: Any, scale: float, texts: list[list[int]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for sample, tokens in enumerate(texts):
        context, continuation = tokens[: args.length], tokens[args.length :]
        full, first = prefill(model, context, scale, args.queries)
        everything = np.arange(len(context))
        reference = greedy(model, full.keeping(everything), first, len(context), args.generate)
        base = continuation_nll(model, full.keeping(everything), first, len(context), continuation)
        rows.append({"sample": sample, "press": "full", "ratio": 1, "kept": len(context), "nll": base,
                     "agreement": 1.0})
        for name in args.presses:
            for ratio in args.ratios:
                press = make_press(name, ratio, args.window, args.queries)
                kept = press.keep(full.view(press))
                kept = everything if kept is None else kept
                nll = continuation_nll(model, full.keeping(kept), first, len(context), continuation)
                tokens_out = greedy(model, full.keeping(kept), first, len(context), args.generate)
                agreement = float(np.mean(np.array(tokens_out) == np.array(reference)))
                rows.append({"sample": sample, "press": name, "ratio": ratio, "kept": int(kept.shape[0]), "nll": nll,
                             "agreement": agreement})
                print(f"sample {sample} {name:12s} {ratio}x kept {kept.shape[0]:5d} ppl {math.exp(nll):8.3f} "
                      f"(full {math.exp(base):.3f}) agreement {agreement:.2f}", flush=True)
    return rows


def needles(args: argparse.Namespace, model: Any, tokenizer: Any, scale: float, tokens: list[int]) -> list[dict]:
    rows: list[dict[str, Any]] = []
    question = tokenizer.encode(QUESTION)
    for length in args.needle_lengths:
        for depth in args.needle_depths:
            number = str(10000 + (length * 7 + int(depth * 100) * 13) % 89999)
            needle = tokenizer.encode(NEEDLE.format(number, number))
            hay = tokens[: length - len(needle) - len(question)]
            at = int(depth * len(hay))
            prompt = hay[:at] + needle + hay[at:] + question
            full, first = prefill(model, prompt, scale, args.queries)
            for name in ["full", *args.presses]:
                kept = np.arange(len(prompt))
                if name != "full":
                    press = make_press(name, args.needle_ratio, args.window, args.queries)
                    chosen = press.keep(full.view(press))
                    kept = kept if chosen is None else chosen
                answer = tokenizer.decode(greedy(model, full.keeping(kept), first, len(prompt), 6))
                rows.append({"press": name, "length": length, "depth": depth, "hit": number in answer,
                             "answer": answer})
                print(f"needle {length:5d} depth {depth:.2f} {name:12s} {'hit ' if number in answer else 'miss'} "
                      f"{answer!r}", flush=True)
    return rows


def describe_text(args: argparse.Namespace) -> str:
    if args.input:
        return "Inputs: " + "; ".join(" + ".join(Path(p).name for p in group) for group in args.input) + "."
    if args.text:
        return f"{args.samples} stretches of " + " + ".join(Path(p).name for p in args.text) + "."
    return f"{args.samples} stretches of paged/data/corpus.txt and GNU/Apache licence texts."


def change(nll: float, base: float) -> str:
    return f"{100 * (math.exp(nll - base) - 1):+.1f}%"


def table(args: argparse.Namespace, rows: list[dict], needle_rows: list[dict], seconds: float) -> str:
    samples = sorted({r["sample"] for r in rows})
    base = {s: next(r["nll"] for r in rows if r["press"] == "full" and r["sample"] == s) for s in samples}
    lines = [
        f"# KV compression quality: SmolLM2-135M (Q4_1 GGUF, fp32, CPU), {len(samples)} input(s) of {args.length} "
        f"tokens",
        "",
        f"Held-out continuation of {args.continuation} tokens (perplexity, teacher-forced) and {args.generate} greedy "
        f"tokens compared position by position with the full cache's; compressed once after the prompt "
        f"(interval 0), recent window {args.window} kept, snapkv from the last {args.queries} queries (kernel 7). "
        f"{describe_text(args)} Perplexity is exp of the mean NLL over inputs; per input: its own change and "
        f"greedy agreement. {seconds:.0f} s on this CPU.",
        "",
        "| press | ratio | kept tokens | perplexity | vs full | greedy agreement | per input: vs full | per input: "
        "agreement |",
        "|---|---|---|---|---|---|---|---|",
    ]
    full = float(np.mean(list(base.values())))
    per_full = " / ".join(f"{math.exp(base[s]):.2f}" for s in samples)
    lines.append(f"| full | 1x | {args.length} | {math.exp(full):.3f} | +0.0% | 1.00 | ppl {per_full} | |")
    for name in args.presses:
        for ratio in args.ratios:
            picked = sorted((r for r in rows if r["press"] == name and r["ratio"] == ratio), key=lambda r: r["sample"])
            nll, agreement = float(np.mean([r["nll"] for r in picked])), np.mean([r["agreement"] for r in picked])
            each = " / ".join(change(r["nll"], base[r["sample"]]) for r in picked)
            each_agreement = " / ".join(f"{r['agreement']:.2f}" for r in picked)
            lines.append(f"| {name} | {ratio}x | {np.mean([r['kept'] for r in picked]):.0f} | {math.exp(nll):.3f} | "
                         f"{change(nll, full)} | {agreement:.2f} | {each} | {each_agreement} |")
    if needle_rows:
        cells = sorted({(r["length"], r["depth"]) for r in needle_rows})
        lines += ["", f"Needle in a haystack at {args.needle_ratio}x (hit: the number among 6 greedy tokens), "
                      "columns length/depth:", "",
                  "| press | " + " | ".join(f"{n}/{d:.2f}" for n, d in cells) + " | hits |",
                  "|---|" + "---|" * (len(cells) + 1)]
        for name in ["full", *args.presses]:
            hits = [next(r["hit"] for r in needle_rows if r["press"] == name and (r["length"], r["depth"]) == cell)
                    for cell in cells]
            lines.append(f"| {name} | " + " | ".join("hit" if h else "miss" for h in hits) +
                         f" | {sum(hits)}/{len(hits)} |")
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    full = math.exp(float(np.mean([r["nll"] for r in rows if r["press"] == "full"])))
    for name in args.presses:
        ppl = [math.exp(float(np.mean([r["nll"] for r in rows if r["press"] == name and r["ratio"] == x])))
               for x in args.ratios]
        agree = [float(np.mean([r["agreement"] for r in rows if r["press"] == name and r["ratio"] == x]))
                 for x in args.ratios]
        left.plot(args.ratios, ppl, marker="o", label=name)
        right.plot(args.ratios, agree, marker="o", label=name)
    left.axhline(full, color="black", linestyle="--", label="full cache")
    left.set(xscale="log", xlabel="compression ratio", ylabel="continuation perplexity", xticks=args.ratios)
    right.set(xscale="log", xlabel="compression ratio", ylabel="greedy agreement with full cache",
              xticks=args.ratios, ylim=(0, 1.05))
    for ax in (left, right):
        ax.minorticks_off()  # the log axis' minor labels (3x10^0) would sit between the ratios
        ax.set_xticklabels([f"{x}x" for x in args.ratios])
    left.legend()
    fig.suptitle(f"SmolLM2-135M, {args.length}-token inputs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens per input (SmolLM2: up to 8192)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--generate", type=int, default=32)
    parser.add_argument("--ratios", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--presses", nargs="+", default=list(PRESSES))
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--needle-lengths", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--needle-depths", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    parser.add_argument("--needle-ratio", type=int, default=4)
    parser.add_argument("--text", nargs="*", default=[], help="files whose text the --samples inputs and the needles' "
                        "haystack come from (default: paged/data/corpus.txt and licence texts)")
    parser.add_argument("--input", nargs="+", action="append", default=[], metavar="FILE",
                        help="one input: the start of these files' text (repeat for more inputs; replaces --samples)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/kv-press-quality"))
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    ex = build_executor(compose_config(["model=smollm2-135m", "logger=none", "progress=false",
                                        "allocator.num_blocks=16", "kernel.backend=torch"]))
    tokens = ex.tokenizer.encode(read_text(args.text))
    if len(tokens) < max(args.needle_lengths, default=0):
        raise SystemExit(f"--needle-lengths need {max(args.needle_lengths)} tokens of text; the text has {len(tokens)}")
    rows = quality(args, ex.model, ex.scale, inputs(args, ex.tokenizer))
    needle_rows = needles(args, ex.model, ex.tokenizer, ex.scale, tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = time.perf_counter() - start
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "quality": rows, "needles": needle_rows}, indent=1))
    (args.out / "table.md").write_text(table(args, rows, needle_rows, seconds))
    plot(args, rows, args.out / "quality.png")
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
