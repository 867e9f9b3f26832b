"""Multi-turn chat: sessions whose every turn re-sends the whole conversation so far.

A chat client sends, for turn k+1, everything said so far, the earlier messages and the model's own
replies, then the user's new message. So each turn's prompt starts with the previous turn's prompt
and reply: the reuse a prefix cache (and a tier keeping evicted prefixes) exists for.

Closed loop: turn k+1 cannot be built before turn k's reply exists, so it is a follow-up
(`WorkloadItem.follows`): its item holds only the new message, and `paged.engine.runner.drive` sends it a
think time after turn k finished, with turn k's prompt and actual reply (on the simulator its
placeholder reply) before the message. Think times are exponential with mean `think_time_s`
(0: none), from the seeded stream THINK_STREAM.

Lengths come from a shipped trace (`path`, conf/workload/multiturn.yaml: Azure's conversation trace):
every turn draws one row at random, its prompt length × `length_scale` the new message's length and
its output length × `length_scale` the turn's max_tokens, clipped to [`prompt_len_min`,
`prompt_len_max`] and [`output_len_min`, `output_len_max`].

Sessions: `num_sessions` arrive Poisson at `arrival_rate` sessions/s (0: all at t = 0), each of
`turns_per_session` turns. With `shared_prefix_len` > 0 a session's first turn starts with one of
`num_prefixes` shared prefixes (a system prompt, picked by `prefix_popularity`). Every request names
its session as its client (`session-<k>`), so `router=session` keeps a conversation on one replica;
priorities are drawn as for every kind, `num_clients` must be 0.

The length limit: a conversation ends early, with fewer turns, where its next turn could outgrow
`scheduler.max_model_len`: turn k is kept only if its prompt, counting every earlier reply at its
full max_tokens, plus its own max_tokens fits. A reply never exceeds its max_tokens, so no prompt is
ever cut; one warning says how many sessions ended early (one whose first turn does not fit has no turns).

The count: `num_requests`, when set, caps the turns (requests) over all sessions, kept in session
order up to the cap; null: every turn, `num_sessions` × `turns_per_session` at most. Items are in
session order, turn by turn (req-0, req-1, ...), the order requests.jsonl lists them; a follow-up's
`arrival_time` is its session's start until the runner sets the real one.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from paged.config import ConfigError, WorkloadConfig
from paged.request import FollowUp, SamplingParams
from paged.workload.lengths import token_ids
from paged.workload.popularity import choose_prefixes
from paged.workload.records import THINK_STREAM, Tokenizer, WorkloadItem, arrivals, request_mix, workload_sampling
from paged.workload.trace import check_trace, read_trace

log = logging.getLogger(__name__)


def multiturn_source(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer | None,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[WorkloadItem]:
    """The chat sessions' turns: first turns as requests, later ones as follow-ups."""
    return conversations(cfg, tokenizer, vocab_size=vocab_size, max_model_len=max_model_len, client="session")


def check_conversations(cfg: WorkloadConfig) -> None:
    """Before any model loads: the session keys are in range and the trace can be read."""
    for key in ("num_sessions", "turns_per_session"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"workload.{key}={value!r} must be an integer >= 1 (workload={cfg.kind})")
    think = cfg.think_time_s
    if isinstance(think, bool) or not isinstance(think, (int, float)) or not math.isfinite(think) or think < 0:
        raise ConfigError(f"workload.think_time_s={think!r} must be a finite number of seconds >= 0 (0: no think time)")
    if cfg.num_clients:
        raise ConfigError(
            f"workload.num_clients={cfg.num_clients} must be 0 for workload={cfg.kind}: each request's client is "
            "its session, so that router=session keeps a conversation on one replica"
        )
    if not cfg.path:
        raise ConfigError(f"workload={cfg.kind} needs workload.path=TRACE (its message and reply lengths)")
    check_trace(cfg)


def conversations(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer | None,
    *,
    vocab_size: int | None,
    max_model_len: int | None,
    client: str,
) -> list[WorkloadItem]:
    """Sessions of turns (module docstring); each request's client is `<client>-<session>`."""
    check_conversations(cfg)
    sampling = workload_sampling(cfg)
    sampling["ignore_eos"] = cfg.ignore_eos
    rng = np.random.default_rng(cfg.seed)
    table = read_trace(str(cfg.path))
    shape = (cfg.num_sessions, cfg.turns_per_session)
    rows = table[rng.integers(len(table), size=shape)]
    message = _scaled(cfg, rows[..., 1], cfg.prompt_len_min, cfg.prompt_len_max)
    reply = _scaled(cfg, rows[..., 2], cfg.output_len_min, cfg.output_len_max)
    starts = arrivals(rng, cfg.arrival_rate, cfg.num_sessions).tolist()
    turns = _turns(cfg, message, reply, max_model_len)
    think = np.zeros(shape)
    if cfg.think_time_s > 0:
        think = np.random.default_rng([cfg.seed, THINK_STREAM]).exponential(cfg.think_time_s, size=shape)
    kept = np.arange(cfg.turns_per_session) < turns[:, None]
    prefixes, bodies = token_ids(cfg, tokenizer, vocab_size, message[kept], rng)
    prefix_of = choose_prefixes(cfg, len(prefixes), cfg.num_sessions)
    _, priorities = request_mix(cfg, len(bodies))
    items: list[WorkloadItem] = []
    for session, num_turns in enumerate(turns.tolist()):
        parent: str | None = None
        for turn in range(num_turns):
            ids = bodies[len(items)]
            if turn == 0:
                ids = prefixes[prefix_of[session]] + ids
            request_id = f"req-{len(items)}"
            items.append(WorkloadItem(
                request_id, ids, SamplingParams(max_tokens=int(reply[session, turn]), **sampling),
                starts[session], priority=priorities[len(items)], client_id=f"{client}-{session}",
                follows=None if parent is None else FollowUp(parent, float(think[session, turn])),
            ))
            parent = request_id
    return items


def _scaled(cfg: WorkloadConfig, values: np.ndarray, lo: int, hi: int | None) -> np.ndarray:
    return np.clip(np.round(values * cfg.length_scale), lo, hi).astype(np.int64)


def _turns(cfg: WorkloadConfig, message: np.ndarray, reply: np.ndarray, max_model_len: int | None) -> np.ndarray:
    """Per session, its turns: those that fit `max_model_len` (warning when a session ends early),
    then capped by `num_requests` in session order."""
    turns = np.full(cfg.num_sessions, cfg.turns_per_session)
    if max_model_len is not None:
        # turn k's prompt + max_tokens with every earlier reply at its full max_tokens
        longest = cfg.shared_prefix_len + np.cumsum(message + reply, axis=1)
        turns = np.cumprod(longest <= max_model_len, axis=1).sum(axis=1)
        short = int(np.count_nonzero(turns < cfg.turns_per_session))
        if short:
            log.warning(
                "workload=%s: %d of %d sessions end early (%d of %d turns kept) so that no conversation outgrows "
                "scheduler.max_model_len=%d", cfg.name, short, cfg.num_sessions, int(turns.sum()),
                cfg.num_sessions * cfg.turns_per_session, max_model_len,
            )
    if cfg.num_requests is not None:
        before = np.cumsum(turns) - turns
        turns = np.clip(cfg.num_requests - before, 0, turns)
    if not turns.sum():
        raise ValueError(
            f"workload={cfg.name}: no session has a turn that fits scheduler.max_model_len={max_model_len}; "
            "shorten workload.shared_prefix_len or the lengths (workload.length_scale, *_len_max)"
        )
    return turns
