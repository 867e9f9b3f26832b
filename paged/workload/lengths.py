"""Length-only workloads (synthetic, fixed, trace): from a source's per-request lengths to requests.

A length source gives each request's prompt length (after the shared prefix), output length and
arrival time, drawn from the request stream `default_rng(seed)`. `LengthSource` does the rest, the
same for every such source, so that the sources differ only in what they model:

Shared prefixes: `shared_prefix_len` tokens, the same in every request, are prepended to each
sampled (synthetic, trace) prompt; for `fixed` they are part of `prompt_len`. With `num_prefixes`
k > 1 there are k distinct prefixes of that length and each request gets one at random (equally
likely, or Zipf-skewed: `prefix_popularity`, popularity.py), so requests sharing a prefix interleave
in arrival order (a shuffled shared-prefix workload, for longest-prefix-match studies).

Clipping: the synthetic and trace sources clip their sampled lengths to the config's [`*_len_min`,
`*_len_max`] (a None max means no such limit). Then, when the caller passes the scheduler's
`max_model_len`, every length is cut to fit it, as the paper's setup cuts sequences to the model's
max length: the whole prompt (prefix included) to at most `max_model_len - 1` tokens, so at least
one token can be generated, then the output so that prompt + output <= `max_model_len`. This second
step wins over `*_len_min`; it logs one warning saying how many requests it cut (a length the user
gives exactly, `fixed`'s, must fit instead: `paged.config.validate.check_lengths`).

Token ids: with a tokenizer, prompts are windows of a built-in corpus so a real model reads real
language. A spec-only model has no tokenizer, so it gets seeded uniform ids in [0, vocab_size).
Either way the shared prefix is the same ids in every request, so prefix caching hashes and hits
exactly as on a real model.

Sampling: every request gets the workload's sampling keys (`records.workload_sampling`) and its
`ignore_eos`, with its output length as `max_tokens`.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import NamedTuple

import numpy as np

from paged.config import WorkloadConfig
from paged.request import SamplingParams
from paged.workload.popularity import choose_prefixes
from paged.workload.records import PREFIX_STREAM, Tokenizer, WorkloadItem, request_mix, workload_sampling

log = logging.getLogger(__name__)


class Lengths(NamedTuple):
    """Per request: prompt tokens after the shared prefix, output tokens, arrival time (s)."""

    body: np.ndarray
    output: np.ndarray
    arrival: np.ndarray


@dataclass(frozen=True)
class LengthSource:
    """A length-only workload kind: `draw` gives the lengths from the config and the request
    stream; `whole` says `num_requests` None means all the source has (a trace's every row)."""

    draw: Callable[[WorkloadConfig, np.random.Generator], Lengths]
    whole: bool = False

    def __call__(
        self,
        cfg: WorkloadConfig,
        tokenizer: Tokenizer | None,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> list[WorkloadItem]:
        """The requests: `tokenizer` None (a spec-only model) draws ids below `vocab_size`;
        `max_model_len` (the scheduler's) clips the lengths to fit it."""
        if cfg.num_requests is None and not self.whole:
            raise ValueError(
                "workload.num_requests=None (the whole trace) is only for workload=trace; "
                f"workload={cfg.kind} needs a request count"
            )
        if max_model_len is not None and cfg.shared_prefix_len >= max_model_len:
            raise ValueError(
                f"workload.shared_prefix_len={cfg.shared_prefix_len} leaves no room to generate: it must be "
                f"< scheduler.max_model_len={max_model_len}"
            )
        sampling = workload_sampling(cfg)
        rng = np.random.default_rng(cfg.seed)
        lengths = self.draw(cfg, rng)
        body, output = lengths.body, lengths.output
        if max_model_len is not None:
            body, output = _fit(cfg, body, output, max_model_len)
        prefixes, bodies = token_ids(cfg, tokenizer, vocab_size, body, rng)
        prefix_of = choose_prefixes(cfg, len(prefixes), len(bodies))
        clients, priorities = request_mix(cfg, len(bodies))
        if cfg.tenant_prefixes:
            # a tenant's requests share its system prompt: client k's prefix is prefix k mod num_prefixes
            tenant = {f"client-{k}": k % len(prefixes) for k in range(cfg.num_clients)}
            prefix_of = [tenant[c] for c in clients]
        # read once: a DictConfig attribute costs microseconds, too much per request at paper scale
        sampling["ignore_eos"] = cfg.ignore_eos
        items = []
        # 4 bytes a token: a fleet hour's prompts are 77M tokens, ~36 bytes each as a list's ints
        held = [array("i", prefix) for prefix in prefixes]
        per_request = zip(bodies, output.tolist(), lengths.arrival.tolist(), prefix_of, clients, priorities)
        for i, (ids, o_len, t, p, client, priority) in enumerate(per_request):
            params = SamplingParams(max_tokens=o_len, **sampling)
            prompt = held[p] + array("i", ids)
            items.append(WorkloadItem(f"req-{i}", prompt, params, t, priority=priority, client_id=client))
        return items


def _fit(
    cfg: WorkloadConfig, body: np.ndarray, output: np.ndarray, max_model_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """The lengths cut to fit `max_model_len`, with one warning saying how many requests were cut:
    a sampled length over the limit is the distribution's tail, not an error, but never silent."""
    fitted_body = np.minimum(body, max_model_len - 1 - cfg.shared_prefix_len)
    fitted_output = np.minimum(output, max_model_len - cfg.shared_prefix_len - fitted_body)
    prompts_cut = int(np.count_nonzero(fitted_body < body))
    cut = int(np.count_nonzero((fitted_body < body) | (fitted_output < output)))
    if cut:
        log.warning(
            "workload=%s: %d of %d requests clipped to fit scheduler.max_model_len=%d (%d prompts cut to %d tokens, "
            "then outputs cut so prompt + output <= %d)", cfg.name, cut, len(body), max_model_len, prompts_cut,
            max_model_len - 1, max_model_len,
        )
    return fitted_body, fitted_output


def token_ids(
    cfg: WorkloadConfig, tokenizer: Tokenizer | None, vocab_size: int | None, body: np.ndarray, rng: np.random.Generator
) -> tuple[list[list[int]], list[list[int]]]:
    """The `num_prefixes` prefixes (all distinct) and, per length in `body`, that many ids after a
    prefix (corpus windows with a tokenizer, else seeded ids below `vocab_size`)."""
    if tokenizer is not None:
        prefixes, bodies = _corpus_ids(tokenizer, cfg.shared_prefix_len, cfg.num_prefixes, body, rng)
    elif vocab_size is not None:
        prefixes, bodies = _random_ids(cfg, vocab_size, body, rng)
    else:
        raise ValueError(
            f"workload={cfg.kind} without a tokenizer (a spec-only model) needs vocab_size= to draw "
            "synthetic token ids"
        )
    distinct = len(set(map(tuple, prefixes)))
    if distinct < len(prefixes):
        # short prefixes of a small vocabulary or corpus can coincide; two equal ones would be one
        # prefix to the cache, silently fewer than asked for
        raise ValueError(
            f"workload.num_prefixes={cfg.num_prefixes}: only {distinct} distinct prefixes "
            f"of workload.shared_prefix_len={cfg.shared_prefix_len} tokens could be drawn; use fewer or longer "
            "prefixes"
        )
    return prefixes, bodies


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """Cut `flat`, an object array of Python ints, into one list per request. The lists point at
    the array's int objects, so each distinct id is one object (not 32 bytes per token, millions of
    tokens at paper scale), and no int is created per token."""
    ends = np.cumsum(lengths).tolist()
    return [flat[end - n : end].tolist() for end, n in zip(ends, lengths.tolist())]


def _corpus_ids(
    tokenizer: Tokenizer, prefix_len: int, num_prefixes: int, body: np.ndarray, rng: np.random.Generator
) -> tuple[list[list[int]], list[list[int]]]:
    """`num_prefixes` windows of `prefix_len` tokens at evenly spaced corpus starts (the first at
    the corpus's start), and per request a window from a random start; windows wrap around at the
    corpus end."""
    text = resources.files("paged.data").joinpath("corpus.txt").read_text()
    tokens = np.asarray(tokenizer.encode(text), dtype=object)
    # one draw per request, in request order: the same stream as drawing them one by one
    starts = rng.integers(len(tokens), size=len(body))
    offsets = np.arange(int(body.sum())) - np.repeat(np.cumsum(body) - body, body)
    flat = tokens[(np.repeat(starts, body) + offsets) % len(tokens)]
    prefix_starts = np.arange(num_prefixes) * len(tokens) // num_prefixes
    prefixes = tokens[(prefix_starts[:, None] + np.arange(prefix_len)) % len(tokens)].tolist()
    return prefixes, _split(flat, body)


def _random_ids(
    cfg: WorkloadConfig, vocab_size: int, body: np.ndarray, rng: np.random.Generator
) -> tuple[list[list[int]], list[list[int]]]:
    """Seeded uniform ids in [0, vocab_size) for a model without a tokenizer: `num_prefixes`
    prefixes, then the request bodies."""
    vocab = np.arange(vocab_size).astype(object)
    prefix_rng = np.random.default_rng([cfg.seed, PREFIX_STREAM])
    # row by row from one stream, so prefix 0 is the very ids a single shared prefix has
    prefixes = vocab[prefix_rng.integers(vocab_size, size=(cfg.num_prefixes, cfg.shared_prefix_len))].tolist()
    return prefixes, _split(vocab[rng.integers(vocab_size, size=int(body.sum()))], body)
