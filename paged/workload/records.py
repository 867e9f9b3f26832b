"""What every request source shares: the request record, the per-request draws, the sampling keys.

A source turns `cfg.workload` into `WorkloadItem`s, the engine's input. Besides each source's own
lengths, three things are drawn or set the same way whichever source built the request:

Arrivals: Poisson at `arrival_rate` requests/s (0 submits everything at t = 0), drawn from the
request stream `default_rng(seed)` after the source's lengths, so the same seed gives the same
schedule. A trace replay keeps the trace's own arrival gaps instead.

Clients and priorities: with `num_clients` k > 0 each request names a client, `client-0` ..
`client-{k-1}`, drawn in proportion to `client_weights` (equal shares when None); with 0 it names
none (`client_id` None). With `num_priorities` k > 0 each request's priority is uniform in [0, k);
with 0 it is 0. Each such draw comes from its own stream `default_rng([seed, k])` (the stream
numbers below, kept in one place so no two draws share one), so turning a draw on, or changing its
setting, leaves the lengths, arrivals, token ids and other draws of every request as they were.

Sampling: the workload's `temperature` (default 0.0, greedy, not SamplingParams' 1.0), `n`,
`best_of`, `use_beam_search` and `length_penalty` set every generated request's sampling and are the
defaults of every prompt-file line. A combination SamplingParams rejects (beam search with n = 1,
n = 0, ...) raises a ConfigError naming the `workload.` keys; the builder checks it before any weights load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from paged.config import ConfigError, WorkloadConfig
from paged.request import FollowUp, SamplingParams

# The seeded streams besides the request stream `default_rng(seed)`, each `default_rng([seed, k])`.
PREFIX_STREAM = 1  # the synthetic prefix ids: they do not change with the request count or lengths
CLIENT_STREAM = 2
PRIORITY_STREAM = 3
PREFIX_CHOICE_STREAM = 4  # which of `num_prefixes` prefixes each request gets
THINK_STREAM = 5  # multi-turn and agent workloads: the think time before each follow-up
# The workload keys that set every request's sampling (for prompt files: the defaults of each line)
WORKLOAD_SAMPLING_KEYS = ("temperature", "n", "best_of", "use_beam_search", "length_penalty")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class WorkloadItem:
    request_id: str
    # a list, or 4-byte ints (`array('i')`) where a workload draws many (the length-only sources)
    prompt_token_ids: Sequence[int]
    params: SamplingParams | None
    arrival_time: float = 0.0
    prompt: str | None = None
    priority: int = 0
    client_id: str | None = None  # None: the workload names no clients
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # a follow-up (multi-turn, agent): `prompt_token_ids` are its new message only; the runner sends it
    # once the request it follows finished, with that request's prompt and reply before the message
    follows: FollowUp | None = None


def arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s; rate 0 submits everything at t = 0."""
    if rate <= 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, n))


def request_mix(cfg: WorkloadConfig, n: int) -> tuple[list[str | None], list[int]]:
    """Per request: the client it names (None when `num_clients` is 0) and its priority."""
    clients: list[str | None] = [None] * n
    if cfg.num_clients > 0:
        weights = np.ones(cfg.num_clients) if cfg.client_weights is None else np.array(list(cfg.client_weights))
        names = [f"client-{k}" for k in range(cfg.num_clients)]
        drawn = np.random.default_rng([cfg.seed, CLIENT_STREAM]).choice(
            cfg.num_clients, size=n, p=weights / weights.sum()
        )
        clients = [names[k] for k in drawn.tolist()]
    priorities = [0] * n
    if cfg.num_priorities > 0:
        priorities = np.random.default_rng([cfg.seed, PRIORITY_STREAM]).integers(cfg.num_priorities, size=n).tolist()
    return clients, priorities


def workload_sampling(cfg: WorkloadConfig) -> dict[str, Any]:
    """The workload's sampling keys, checked once here so that a combination SamplingParams rejects
    fails before the run, naming the workload keys, rather than on every request."""
    sampling = {key: getattr(cfg, key) for key in WORKLOAD_SAMPLING_KEYS}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        # json.dumps writes the values as a Hydra override would (true, null), ready to correct
        settings = " ".join(f"workload.{key}={json.dumps(value)}" for key, value in sampling.items())
        raise ConfigError(f"{settings} is not a valid sampling setup: {e}") from None
    return sampling
