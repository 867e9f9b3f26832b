"""Agents: one long context all agents share, and per agent a trajectory that grows step by step.

A tool-using agent sends, at every step, the same long context (tool documentation, a repository),
then its trajectory so far, its earlier actions (the model's outputs) and the tool results they got,
then the newest tool result. That is the multi-turn machinery (multiturn.py) with the shared context
as every session's start: sessions are agents (client `agent-<k>`), turns are steps, messages are
tool results and the think time is a tool's run time. The context is `shared_prefix_len` tokens,
required here, one for all agents (`num_prefixes` > 1: several, picked by `prefix_popularity`).

Its reuse differs from a chat's: every step of every agent shares the long context (a hit across
sessions), and each step its own agent's trajectory (a hit within one). conf/workload/agent.yaml
draws the lengths from Azure's code trace: long prompts and short outputs, big tool results and
short actions.
"""

from __future__ import annotations

from paged.config import ConfigError, WorkloadConfig
from paged.workload.multiturn import check_conversations, conversations
from paged.workload.records import Tokenizer, WorkloadItem


def agent_source(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer | None,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[WorkloadItem]:
    """Each agent's steps: its first as a request after the shared context, later ones as follow-ups."""
    check_agent(cfg)
    return conversations(cfg, tokenizer, vocab_size=vocab_size, max_model_len=max_model_len, client="agent")


def check_agent(cfg: WorkloadConfig) -> None:
    """Before any model loads: a shared context, and the session keys and trace (`check_conversations`)."""
    if cfg.shared_prefix_len <= 0:
        raise ConfigError(
            f"workload.shared_prefix_len={cfg.shared_prefix_len} must be > 0 for workload=agent: it is the context "
            "every agent's every step starts with (tool docs, a repository)"
        )
    check_conversations(cfg)
