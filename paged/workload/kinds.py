"""The workload kinds: `workload.kind` -> the source that builds its requests.

A small registry, one entry per kind, in the order the "not supported" error lists them. Every
entry is called the same way (`WorkloadSource`), so a new source is one module and one line here.
`check_inputs` is what the builder checks of a workload before any weights load.
"""

from __future__ import annotations

from typing import Protocol

from paged.config import ConfigError, WorkloadConfig
from paged.workload.agent import agent_source, check_agent
from paged.workload.fixed import fixed_lengths
from paged.workload.lengths import LengthSource
from paged.workload.multiturn import check_conversations, multiturn_source
from paged.workload.popularity import check_popularity
from paged.workload.prompts import check_prompt_file, prompt_source
from paged.workload.records import Tokenizer, WorkloadItem, workload_sampling
from paged.workload.synthetic import synthetic_lengths
from paged.workload.trace import check_trace, trace_lengths


class WorkloadSource(Protocol):
    def __call__(
        self,
        cfg: WorkloadConfig,
        tokenizer: Tokenizer | None,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> list[WorkloadItem]: ...


SOURCES: dict[str, WorkloadSource] = {
    "synthetic": LengthSource(synthetic_lengths),
    "fixed": LengthSource(fixed_lengths),
    "trace": LengthSource(trace_lengths, whole=True),
    "prompts": prompt_source,
    "multiturn": multiturn_source,
    "agent": agent_source,
}


def check_inputs(cfg: WorkloadConfig, *, has_tokenizer: bool, model_name: str = "this model") -> None:
    """What can be checked of `cfg` without a model, so that it fails before any weights load: the
    sampling keys, the prefix popularity, a tokenizer for prompt files (`has_tokenizer`: the model
    has one), the prompt or trace file, and the session keys of multiturn and agent. Raises
    ConfigError (FileNotFoundError for a missing file)."""
    workload_sampling(cfg)
    check_popularity(cfg)
    if cfg.kind == "prompts":
        if not has_tokenizer:
            raise ConfigError(
                f"workload=prompts needs a tokenizer to encode its prompts; model={model_name} is spec-only "
                "(no weights, no tokenizer): use workload=synthetic, fixed or trace, or a model with weights"
            )
        check_prompt_file(cfg)
    elif cfg.kind == "trace":
        check_trace(cfg)
    elif cfg.kind == "multiturn":
        check_conversations(cfg)
    elif cfg.kind == "agent":
        check_agent(cfg)


def load_workload(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer | None,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[WorkloadItem]:
    """The requests `cfg` describes. `tokenizer` None (a spec-only model) draws synthetic ids below
    `vocab_size`; `max_model_len` (the scheduler's) clips length-only workloads to fit it."""
    source = SOURCES.get(cfg.kind)
    if source is None:
        raise ValueError(f"workload.kind={cfg.kind!r} is not supported; allowed: {', '.join(SOURCES)}")
    return source(cfg, tokenizer, vocab_size=vocab_size, max_model_len=max_model_len)
