"""Attention through the paged KV cache, as the model's per-layer callback.

`PagedAttention` is built once per step from the step's `BatchInput` (`paged.executor.step_plan`):
it plans the cache write and the attention ops once (`paged.kernels.planned`: the rows' values
checked on the host, the backend's per-step work done), and the model calls it once per layer with
that layer's q, k and v. A step may mix decode rows (one new token) and prefill rows (several,
possibly after cached ones): decode rows run the `paged_attention` kernel (v1 or v2), prefill rows
`prefill_attention`, one call each, so tokens a prefix-cache hit already holds are never
recomputed. With a sliding window both ops attend only the last `sliding_window` positions, and
never read the blocks wholly before them (the block manager may have freed those).

Layers may differ (Gemma's sliding and global layers): each layer has a route (`LayerRoute`) to
its attention type's settings (window, scale, soft-cap), to its KV group's block tables and cache
slots (`paged.kv_layout`), and to the KV tensor it writes and reads. The ops are planned once per
(group, type) pair the layers use, so a model with one type and one group plans what it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged.executor.attention_scores import StepScores
from paged.executor.kv_scales import KVScales
from paged.executor.step_plan import BatchInput
from paged.kernels.backends.interface import CacheView
from paged.kernels.planned import AttentionSettings, CacheWrite, DecodeAttention, PrefillAttention, WriteThenAttend
from paged.kernels.registry import get_backend
from paged.kernels.split_plan import SplitPlan
from paged.kernels.stack_attention import StackAttention
from paged.kv_layout import KVLayout

# the activations' dtypes the native layer stack runs (paged.model.decode_layers), whose caches hold them as they are
_STACK_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class LayerRoute:
    """Where one layer's attention goes: its KV group (whose block tables it reads), its attention
    type (an index into the settings) and its KV tensor (`KVLayout.slot_of_layer`)."""

    group: int
    kind: int
    slot: int


@dataclass
class _StepOps:
    """One (group, type) pair's ops for the step. `joined`: the later layers of a step that only
    decodes or only prefills, as one call (`WriteThenAttend`), made after the first layer
    (`planned` once it was tried)."""

    write: CacheWrite
    decode: DecodeAttention | None
    prefill: PrefillAttention | None
    joined: WriteThenAttend | None = None
    planned: bool = False


def layer_routes(layout: KVLayout, kinds: Sequence[int]) -> tuple[LayerRoute, ...]:
    """Every layer's route, from the layout and each layer's attention type."""
    return tuple(LayerRoute(group, kind, slot)
                 for group, kind, slot in zip(layout.group_of_layer, kinds, layout.slot_of_layer, strict=True))


class PagedAttention:
    """The model's attention for one step: `(layer, q, k, v[, out]) -> out`, rows in batch order; the
    executor sets it as the forward context's (`paged.kernels.forward_context`), where the layer-level
    op `torch.ops.paged.attention` that the model calls finds it.
    `settings` is one attention type's, or each type's that `routes` names (None: every layer is
    type 0 in group 0 and writes KV tensor `layer`); `decode_version` (v1/v2/v3) is the kernel the
    decode rows run, `None` when the step has none; `kv_scales` the fp8 cache's scales (`None` for a
    cache in the model's dtype)."""

    def __init__(
        self,
        batch: BatchInput,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        settings: AttentionSettings | Sequence[AttentionSettings],
        *,
        decode_version: str | None,
        num_heads: int,
        kv_scales: KVScales | None = None,
        routes: Sequence[LayerRoute] | None = None,
        scores: StepScores | None = None,
    ) -> None:
        assert (decode_version is None) == (batch.decode is None), "decode rows need a version, and only they"
        kinds = [settings] if isinstance(settings, AttentionSettings) else list(settings)
        if routes is None:
            routes = [LayerRoute(0, 0, layer) for layer in range(len(key_caches))]
        self.batch = batch
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.kv_scales = kv_scales
        self.scores = scores
        num_blocks, num_kv_heads, head_size, block_size = value_caches[0].shape
        writes: dict[int, CacheWrite] = {}
        ops: dict[tuple[int, int], _StepOps] = {}
        for route in routes:
            rows = batch.group(route.group)
            if route.group not in writes:
                writes[route.group] = CacheWrite(rows.slot_mapping, rows.host_slot_mapping, kinds[0].backend,
                                                 num_blocks * block_size)
            if (route.group, route.kind) not in ops:
                s = kinds[route.kind]
                decode = None if rows.decode is None or decode_version is None else DecodeAttention(
                    rows.decode, s, decode_version, num_heads, num_kv_heads, head_size, num_blocks, block_size)
                prefill = None if rows.prefill is None else PrefillAttention(
                    rows.prefill, s, num_kv_heads, head_size, num_blocks, block_size)
                ops[route.group, route.kind] = _StepOps(writes[route.group], decode, prefill)
        # per layer: its ops and its KV tensor; one set of ops: one KV group and attention type
        self.layers = [(ops[r.group, r.kind], r.slot) for r in routes]
        self._one_op = len(ops) == 1
        self.groups = [r.group for r in routes]

    def stack_attention(self) -> StackAttention | None:
        """This step's attention as one native call of every layer runs it (`paged.kernels.stack_attention`):
        decode rows only, one KV group and attention type whose layer l writes KV tensor l, the cpu
        backend's v3 with no feature, fp8 scale or score; None for any other step."""
        ops = self.layers[0][0] if self.layers else None
        if ops is None or ops.decode is None or ops.prefill is not None or self.scores is not None:
            return None
        decode, settings = ops.decode, ops.decode.settings
        backend, plan, key_cache = get_backend(settings.backend), decode.workspace, self.key_caches[0]
        # The executor allocates its caches alike (`allocate_kv`: contiguous, one dtype), so the first
        # stands for all, and resolved the backend for their dtype, head and block size (`init_kv_cache`).
        if (backend.name != "cpu" or decode.version != "v3" or not isinstance(plan, SplitPlan) or decode.window
                or self.kv_scales is not None or settings.alibi_slopes is not None or settings.blocksparse is not None
                or settings.soft_cap is not None or key_cache.dtype not in _STACK_DTYPES
                or not key_cache.is_contiguous() or not self._one_op or len(self.layers) != len(self.key_caches)
                or any(slot != i for i, (_, slot) in enumerate(self.layers))):
            return None
        num_blocks, block_size = self.value_caches[0].shape[0], self.value_caches[0].shape[-1]
        rows = decode.rows
        return StackAttention(self.key_caches, self.value_caches, ops.write.slot_mapping, num_blocks * block_size,
                              rows.block_tables, rows.seq_lens, settings.scale, plan.num_splits, plan.split_blocks,
                              rows.max_seq_len)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer`'s attention output, written into `out` when given (a contiguous tensor like
        `q`, as `torch.ops.paged.attention` passes it), else into a new tensor."""
        ops, slot = self.layers[layer]
        key_cache, value_cache = caches = self.key_caches[slot], self.value_caches[slot]
        scales = (None, None) if self.kv_scales is None else self.kv_scales.for_layer(layer, k, v)
        if ops.joined is not None:
            if out is None:
                out = torch.empty_like(q)
            if ops.joined((k, v, key_cache, value_cache, *scales, out, q)):
                return out
        ops.write(k, v, *caches, *scales)
        if self.scores is not None:
            self._score(layer, q, caches, scales)
        if ops.prefill is None or ops.decode is None:
            attend = ops.prefill if ops.decode is None else ops.decode
            assert attend is not None
            out = attend(q, *caches, *scales, out=out)
            if not ops.planned:
                ops.planned = True
                ops.joined = None if self.scores is not None else WriteThenAttend.of(ops.write, attend)
            return out
        b = self.batch
        if out is None:
            out = torch.empty_like(q)
        out[b.decode_tokens] = ops.decode(q[b.decode_tokens], *caches, *scales)
        out[b.prefill_tokens] = ops.prefill(q[b.prefill_tokens], *caches, *scales)
        return out

    def _score(self, layer: int, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
               scales: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """The layer's attention mass for the press (`StepScores`), beside (not inside) its ops, so
        that a step no press scores runs exactly as before."""
        assert self.scores is not None
        b = self.batch
        ops = self.layers[layer][0]
        decode, prefill = ops.decode, ops.prefill
        for op, tokens, is_decode in ((decode, b.decode_tokens, True), (prefill, b.prefill_tokens, False)):
            if op is not None:
                rows_q = q if tokens is None or decode is None or prefill is None else q[tokens]
                cache = CacheView(*caches, op.rows.block_tables, op.rows.seq_lens, *scales)
                self.scores.add(rows_q, cache, op.rows, op.settings, is_decode, self.groups[layer])
