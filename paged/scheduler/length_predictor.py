"""Output-length predictors for length-aware policies (SJF), chosen by name.

Why: shortest-job-first needs a job's length before it runs, and an LLM request's length is mostly
its output, which is unknown at admission. The registry holds the reference points a study needs:
`oracle` (the true length: the bound on what prediction can buy), `bucket-mean` (a cheap online
baseline that learns from finished requests; S3, Jin et al. 2023, predicts a length bucket with a
trained classifier, this one averages what requests of similar prompt length produced) and `none`
(no output estimate: prompt length alone decides). A new predictor is one subclass registered with
`@register("name")` in a module imported before the policy is built.

A prediction is the request's total output length (its longest completion); the policy subtracts
what is already generated.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

from paged.request import Request

log = logging.getLogger(__name__)

PREDICTORS: dict[str, type[OutputLengthPredictor]] = {}


def register(name: str) -> Callable[[type[OutputLengthPredictor]], type[OutputLengthPredictor]]:
    """Class decorator: make a predictor selectable as `predictor: <name>`."""

    def add(cls: type[OutputLengthPredictor]) -> type[OutputLengthPredictor]:
        PREDICTORS[name] = cls
        return cls

    return add


def make_predictor(name: str, prior: float) -> OutputLengthPredictor:
    """The registered predictor `name`; a ValueError lists the names when there is none such."""
    cls = PREDICTORS.get(name)
    if cls is None:
        allowed = ", ".join(repr(n) for n in sorted(PREDICTORS))
        raise ValueError(f"predictor must be one of {allowed}, got {name!r}")
    return cls(prior)


class OutputLengthPredictor(ABC):
    def __init__(self, prior: float) -> None:
        # what a predictor that cannot judge a request yet assumes (a learning one, before it learnt)
        self.prior = prior

    @abstractmethod
    def predict(self, request: Request) -> float:
        """Tokens `request` will generate in all (its longest completion)."""

    def observe(self, request: Request) -> None:  # noqa: B027 - a hook that only learning predictors fill
        """`request` finished or was aborted: a learning predictor updates itself."""


@register("oracle")
class OraclePredictor(OutputLengthPredictor):
    """`max_tokens`, which is the true output length when EOS cannot end a request early
    (`ignore_eos`, as the length-only workloads set it: their `max_tokens` is the sampled length).
    Otherwise it is only an upper bound, and a warning says so once."""

    def __init__(self, prior: float) -> None:
        super().__init__(prior)
        self._warned = False

    def predict(self, request: Request) -> float:
        if not request.params.ignore_eos and not self._warned:
            self._warned = True
            log.warning(
                "predictor=oracle: request %r may stop at EOS (ignore_eos is false), so max_tokens is an upper "
                "bound on its output, not its length; set workload.ignore_eos=true for a true oracle",
                request.request_id,
            )
        return request.params.max_tokens


@register("bucket-mean")
class BucketMeanPredictor(OutputLengthPredictor):
    """The mean output length of finished requests whose prompt length has the same power of two
    (bucket [2^(k-1), 2^k)); with none finished in that bucket, the mean over all; before anything
    finished, `prior`. Aborted requests teach nothing: their output was cut short."""

    def __init__(self, prior: float) -> None:
        super().__init__(prior)
        self._sums: dict[int, int] = {}
        self._counts: dict[int, int] = {}
        self._total = 0
        self._count = 0

    def predict(self, request: Request) -> float:
        bucket = request.num_prompt_tokens.bit_length()
        if bucket in self._counts:
            return self._sums[bucket] / self._counts[bucket]
        return self._total / self._count if self._count else self.prior

    def observe(self, request: Request) -> None:
        if request.abort_reason is not None:
            return
        length = max(len(c.token_ids) for c in request.outputs())
        bucket = request.num_prompt_tokens.bit_length()
        self._sums[bucket] = self._sums.get(bucket, 0) + length
        self._counts[bucket] = self._counts.get(bucket, 0) + 1
        self._total += length
        self._count += 1


@register("none")
class NoPredictor(OutputLengthPredictor):
    """No output estimate: jobs are ranked by the tokens they still have to prefill."""

    def predict(self, request: Request) -> float:
        return 0.0
