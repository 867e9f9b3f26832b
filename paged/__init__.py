"""paged: a research framework for LLM KV-cache memory management and PagedAttention."""

from __future__ import annotations

from typing import Any

from paged.utils import threads

# First, before anything imports torch: its OpenMP runtime reads the wait policy once, when it loads.
threads.set_wait_policy_env()

from paged.request import SamplingParams  # noqa: E402

__all__ = ["LLM", "BeamSearchParams", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM pulls in Hydra and the model stack; keep `import paged.memory` and friends light.
    if name in ("LLM", "BeamSearchParams"):
        from paged.api import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'paged' has no attribute {name!r}")
