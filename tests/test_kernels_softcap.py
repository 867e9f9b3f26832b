"""Attention logit soft-capping (Gemma-2's `attn_logit_softcapping`): the torch backend's decode (v1,
v2) and prefill against a naive per-sequence loop, with and without a sliding window; the native
backends refuse it by name, and `kernel.backend=auto` picks a backend that implements it."""

from __future__ import annotations

import pytest
import torch

from paged import kernels
from paged.kernels.features import AttentionFeatures
from paged.kernels.testing import AttentionCase, attention_inputs, causal_attention, gather_kv, prefill_inputs

pytestmark = pytest.mark.compiles

CASE = AttentionCase(torch.float32, 64, 16, 2, 2, 32, (1, 15, 33, 70))
# small enough that the cap bends the logits of the (scaled-up) queries below
CAP = 5.0


def _reference(query: torch.Tensor, x, seq_len: int, row: int, window: int | None, soft_cap: float | None):
    k, v = gather_kv(x.clean_key_cache, x.clean_value_cache, x.block_tables[row], seq_len)
    return causal_attention(query, k, v, x.scale, window, soft_cap)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_torch_decode_soft_caps_the_scaled_logits(version: str, window: int | None) -> None:
    x = attention_inputs(CASE, seed=3)
    query = x.query * 400  # scores far past the cap
    out = kernels.paged_attention(query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                  version=version, partition_size=32, sliding_window=window, soft_cap=CAP)
    uncapped = kernels.paged_attention(query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                       version=version, partition_size=32, sliding_window=window)
    for row, seq_len in enumerate(x.seq_lens.tolist()):
        ref = _reference(query[row : row + 1], x, seq_len, row, window, CAP)
        torch.testing.assert_close(out[row : row + 1], ref, atol=1e-5, rtol=1e-5)
    assert (out - uncapped).abs().max() > 0.1 * out.abs().max(), "the cap must change these outputs"


@pytest.mark.parametrize("window", [None, 20])
def test_torch_prefill_soft_caps_the_scaled_logits(window: int | None) -> None:
    x = prefill_inputs(CASE, [1, 10, 33, 25], seed=4)
    p = x.paged
    out = kernels.prefill_attention(*x.args, sliding_window=window, soft_cap=CAP)
    starts = x.query_start_loc.tolist()
    for row, seq_len in enumerate(p.seq_lens.tolist()):
        rows = slice(starts[row], starts[row + 1])
        torch.testing.assert_close(out[rows], _reference(x.query[rows], p, seq_len, row, window, CAP),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "emu"])
def test_native_backends_refuse_soft_capping_by_name(backend: str) -> None:
    reason = kernels.get_backend(backend).unsupported_reason(
        torch.device("cuda" if backend == "cuda" else "cpu"), torch.float32, 64, 16,
        features=AttentionFeatures(soft_cap=CAP))
    assert reason == (f"attention feature=softcap is not supported by backend='{backend}'; supported: alibi, "
                      "blocksparse")
    assert kernels.backends_serving(AttentionFeatures(soft_cap=CAP)) == ("torch",)


def test_auto_picks_a_backend_that_soft_caps() -> None:
    backend, reason = kernels.resolve_backend("auto", device=torch.device("cpu"), dtype=torch.float32, head_size=64,
                                              block_size=16, partition_size=512,
                                              features=AttentionFeatures(soft_cap=CAP))
    assert backend.name == "torch", reason


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), True])
def test_a_soft_cap_that_is_not_a_positive_finite_number_is_refused(cap: float) -> None:
    x = attention_inputs(CASE)
    with pytest.raises(ValueError, match="soft_cap=.* must be a positive finite number"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                soft_cap=cap)
