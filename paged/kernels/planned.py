"""A step's attention and cache write, checked once and then run layer after layer.

The front-end ops (`paged.kernels.ops`) check every argument on every call, and the checks that
read values (lengths, offsets, slots) read tensors on the host, which on a GPU waits for it. A
model calls them once per layer with the same rows, so an executor plans the step instead: `Rows`
carries the rows' metadata on the device together with the host arrays it was copied from; a
planned op checks those arrays once (`paged.kernels.step_checks`), lets the backend prepare its
per-step work (v2's scratch, the torch prefill's groups), checks the tensors' shapes and dtypes on
the first layer's call, and from then on only runs the backend. Nothing here reads a tensor's
values, so a planned op can be captured in a CUDA graph.

Scales of an fp8 cache are passed per call as fp32 `[num_kv_heads]` tensors on the cache's device
(as `paged.executor.kv_scales` keeps them), or `None`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged.kernels import input_checks, step_checks
from paged.kernels.backends.interface import CacheView, KernelBackend
from paged.kernels.backends.launch import LaunchPlan, RunnerBackend
from paged.kernels.backends.launch_api import VECTOR_BYTES, BoundPart, pointer_slots
from paged.kernels.features import FP8_DTYPES, AttentionFeatures, BlockSparse
from paged.kernels.ops import narrower_window, serving_backend
from paged.kernels.registry import get_backend


@dataclass(frozen=True)
class Rows:
    """The sequences one attention op runs: device tensors and the host arrays they came from."""

    block_tables: torch.Tensor  # int32 [n, max_blocks], zero padded
    seq_lens: torch.Tensor  # int32 [n], context length after this step
    query_start_loc: torch.Tensor  # int32 [n + 1], offsets of each sequence's query rows
    host_block_tables: np.ndarray
    host_seq_lens: np.ndarray
    host_query_start_loc: np.ndarray
    # at least the longest context: a CUDA graph's rows are planned for the longest it may replay
    max_seq_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.host_seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.host_query_start_loc[-1])


@dataclass(frozen=True)
class AttentionSettings:
    """What one attention type of a model is, whatever the step: the backend, the decode kernel's
    partition size, the window, the features (`paged.kernels.features`) and the softmax scale. A
    model whose layers differ (Gemma's sliding and global layers) has one per layer type."""

    backend: KernelBackend
    scale: float
    partition_size: int
    sliding_window: int | None = None
    alibi_slopes: torch.Tensor | None = None
    blocksparse: BlockSparse | None = None
    soft_cap: float | None = None
    # the KV cache's dtype (None: the model's 16-bit one): v3 sizes its splits by the bytes they read
    cache_dtype: torch.dtype | None = None


def check_planned_scales(key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """The front end's scale checks, and that the scales are already in the form the backends take
    (a planned op passes them on as given)."""
    input_checks.cache_scales(key_cache, k_scale, v_scale)
    if key_cache.dtype in FP8_DTYPES and (k_scale is None or v_scale is None):
        raise ValueError(f"a planned op on a {key_cache.dtype} cache needs both k_scale and v_scale")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (key_cache.shape[1],)
                                  or not scale.is_contiguous() or scale.device != key_cache.device):
            raise ValueError(f"{name} of a planned op must be a contiguous float32 [num_kv_heads={key_cache.shape[1]}] "
                             f"tensor on {key_cache.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """`result`, copied into `out` when there is one (the layer-level torch op's output)."""
    if out is None:
        return result
    out.copy_(result)
    return out


class _Planned:
    """Checks the rows' values at construction and the tensors on the first call; on a backend that
    runs `Launch`es, keeps the first layer's launches for the later layers (`_LayerLaunches`)."""

    def __init__(self, rows: Rows, settings: AttentionSettings, num_blocks: int, block_size: int) -> None:
        step_checks.check_rows(
            rows.host_block_tables, rows.host_seq_lens, rows.host_query_start_loc, num_tokens=rows.num_tokens,
            block_size=block_size, num_blocks=num_blocks, max_seq_len=rows.max_seq_len,
        )
        self.rows = rows
        self.settings = settings
        self.backend = settings.backend
        self.window = narrower_window(settings.sliding_window, rows.max_seq_len)
        self.features: AttentionFeatures | None = None  # checked on the first call
        self.layer_launches: _LayerLaunches | None = None

    def _from_first(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    out: torch.Tensor | None) -> torch.Tensor | None:
        """A later layer's output from the first layer's launches, or None (none kept, or this
        layer's tensors are not laid out as the first's)."""
        if self.layer_launches is None:
            return None
        return self.layer_launches.attend(query, key_cache, value_cache, k_scale, v_scale, out)

    def _run_first(self, plan: LaunchPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        """Runs the first layer's `plan` and keeps its launches for the later layers."""
        plan.runner.run(plan.unit, plan.launches)
        self.layer_launches = _LayerLaunches.of(plan, (plan.out, query, key_cache, value_cache, k_scale, v_scale))
        return into(out, plan.out)

    def _cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> CacheView:
        return CacheView(key_cache, value_cache, self.rows.block_tables, self.rows.seq_lens, k_scale, v_scale)

    def _check_first(self, query: torch.Tensor, cache: CacheView, partition_size: int | None) -> AttentionFeatures:
        s = self.settings
        check_planned_scales(cache.key_cache, cache.k_scale, cache.v_scale)
        features = input_checks.check_features(query, cache.block_size, s.alibi_slopes, s.blocksparse,
                                                   s.soft_cap)
        self.backend = serving_backend(s.backend, query, cache.head_size, cache.block_size, partition_size,
                                       cache.key_cache.dtype, features)
        return features


class _BoundRoles:
    """A bound launch (`Runner.bind`) and the layout its roles must have: a call runs it with the
    roles' addresses, or returns False (nothing run) where one is not laid out as the first layer's."""

    def __init__(self, roles: _Roles, launch: Callable[[Sequence[int]], None]) -> None:
        self.roles, self.launch = roles, launch

    def __call__(self, roles: tuple[torch.Tensor | None, ...]) -> bool:
        addresses = self.roles.addresses(roles)
        if addresses is None:
            return False
        self.launch(addresses)
        return True


class _LayerLaunches:
    """A step's launches of one op as the first layer made them (its decode attention, its cache
    write), to run every later layer: a layer's launches differ only in the addresses of its
    `roles` (the tensors it reads and writes: query or new K/V, caches, scales, output). `of` finds
    where each role's address sits in the first layer's arguments; a later layer gets its own
    swapped in, once its tensors are laid out as the first layer's (same shape and strides, and
    16-byte aligned where the first layer's were)."""

    def __init__(self, plan: LaunchPlan, slots: list[list[tuple[int, int]]],
                 layouts: tuple[tuple[tuple[int, ...], tuple[int, ...], bool] | None, ...]) -> None:
        # `plan.keep` stays referenced here: the launches carry its tensors' addresses
        self.plan, self.slots = plan, slots
        self.roles = _Roles(layouts)
        # run(roles): a later layer's launches with its roles swapped in; False (nothing run) where
        # they are not laid out as the first layer's
        self.run = _BoundRoles(self.roles, plan.runner.bind(self.parts(range(len(layouts)))))

    def parts(self, where: Sequence[int]) -> list[BoundPart]:
        """The launches to bind (`Runner.bind`) for a call whose addresses hold role j's at `where[j]`."""
        return [(self.plan.unit, item, [(i, where[j]) for i, j in launch_slots])
                for item, launch_slots in zip(self.plan.launches, self.slots, strict=True)]

    @classmethod
    def of(cls, plan: LaunchPlan, roles: tuple[torch.Tensor | None, ...]) -> _LayerLaunches | None:
        """`roles` of the first layer. None where a role's address is not among the arguments (the
        plan copied it into shape) or two roles share one: then every layer plans its own launches."""
        slots = pointer_slots(plan.launches, [None if t is None else t.data_ptr() for t in roles])
        if slots is None:
            return None
        layouts = tuple(None if t is None else (tuple(t.shape), tuple(t.stride()), t.data_ptr() % VECTOR_BYTES == 0)
                        for t in roles)
        return cls(plan, slots, layouts)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
        """An attention layer's output (in `out` when given), or None where its tensors are not laid
        out as the first layer's."""
        if out is None:
            out = torch.empty_like(query)
        return out if self.run((out, query, key_cache, value_cache, k_scale, v_scale)) else None


class _Roles:
    """The first layer's tensors (roles) as a later layer must lay out its own: the same shape and
    strides, 16-byte aligned where the first's were, absent where the first's were."""

    def __init__(self, layouts: tuple[tuple[tuple[int, ...], tuple[int, ...], bool] | None, ...]) -> None:
        self.layouts = layouts
        self.absent = tuple(j for j, layout in enumerate(layouts) if layout is None)
        self.present = tuple((j, *layout) for j, layout in enumerate(layouts) if layout is not None)

    def addresses(self, roles: tuple[torch.Tensor | None, ...]) -> list[int] | None:
        """The roles' addresses (0 for an absent one), or None where one is not laid out as the
        first layer's."""
        for j in self.absent:
            if roles[j] is not None:
                return None
        addresses = [0] * len(self.layouts)
        for j, shape, stride, aligned in self.present:
            t = roles[j]
            if t is None or t.shape != shape or t.stride() != stride:
                return None
            address = addresses[j] = t.data_ptr()
            if aligned and address % VECTOR_BYTES:
                return None
        return addresses


class WriteThenAttend(_BoundRoles):
    """The later layers of a step whose rows all decode, or all prefill, in one call: the layer's
    cache write and its attention, each from the first layer's launches (`_LayerLaunches`), their
    tensors checked once (the caches and scales are roles of both). Roles: key, value, key_cache,
    value_cache, k_scale, v_scale, out, query."""

    # where each of the attention's roles (out, query, caches, scales) sits among these
    ATTENTION_ROLES = (6, 7, 2, 3, 4, 5)

    def __init__(self, write: _LayerLaunches, attend: _LayerLaunches) -> None:
        super().__init__(_Roles(write.roles.layouts + attend.roles.layouts[:2]),
                         write.plan.runner.bind(write.parts(range(6)) + attend.parts(self.ATTENTION_ROLES)))

    @classmethod
    def of(cls, write: CacheWrite, attend: DecodeAttention | PrefillAttention) -> WriteThenAttend | None:
        """None unless both ops run from their first layer's launches over the same caches."""
        w, d = write.layer_launches, attend.layer_launches
        if w is None or d is None or w.roles.layouts[2:] != d.roles.layouts[2:] or w.plan.runner is not d.plan.runner:
            return None
        return cls(w, d)



class DecodeAttention(_Planned):
    """`paged.kernels.paged_attention` for one step's decode rows (`version` v1, v2 or v3). On a
    backend that runs `Launch`es (cuda, emu), the first layer's launches serve the later layers
    (`_LayerLaunches`): a layer then costs its launches and little else."""

    def __init__(self, rows: Rows, settings: AttentionSettings, version: str, num_heads: int, num_kv_heads: int,
                 head_size: int, num_blocks: int, block_size: int) -> None:
        super().__init__(rows, settings, num_blocks, block_size)
        self.version = version
        self.workspace = self.backend.decode_workspace(
            rows.num_seqs, num_heads, num_kv_heads, head_size, block_size, version, settings.partition_size,
            rows.max_seq_len, self.window, rows.block_tables.device, settings.cache_dtype,
        )

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output, in `out` when given (a contiguous tensor like the query): the later
        layers' launches write it there, other paths copy it in."""
        result = self._from_first(query, key_cache, value_cache, k_scale, v_scale, out)
        if result is not None:
            return result
        cache = self._cache(key_cache, value_cache, k_scale, v_scale)
        first = self.features is None
        if first:
            input_checks.check_paged_attention(query, cache, self.version, self.settings.partition_size)
            partition = self.settings.partition_size if self.version == "v2" else None
            self.features = self._check_first(query, cache, partition)
        args = (query, cache, self.settings.scale, self.version, self.settings.partition_size, self.rows.max_seq_len,
                self.window, self.features, self.workspace)
        if not (first and isinstance(self.backend, RunnerBackend)):
            return into(out, self.backend.paged_attention(*args))
        return self._run_first(self.backend.decode_launches(*args), query, key_cache, value_cache, k_scale, v_scale,
                               out)


class PrefillAttention(_Planned):
    """`paged.kernels.prefill_attention` for one step's prefill rows (or any rows with several
    queries)."""

    def __init__(self, rows: Rows, settings: AttentionSettings, num_kv_heads: int, head_size: int, num_blocks: int,
                 block_size: int) -> None:
        super().__init__(rows, settings, num_blocks, block_size)
        self.plan = self.backend.plan_prefill(
            rows.host_query_start_loc, rows.host_seq_lens, rows.host_block_tables, block_size, num_kv_heads,
            head_size, self.window, rows.block_tables.device,
        )

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' output, in `out` when given: on a backend that runs `Launch`es the later layers
        run from the first layer's launch (`_LayerLaunches`) and write it there, other paths copy it in."""
        result = self._from_first(query, key_cache, value_cache, k_scale, v_scale, out)
        if result is not None:
            return result
        cache = self._cache(key_cache, value_cache, k_scale, v_scale)
        first = self.features is None
        if first:
            input_checks.check_prefill_attention(query, cache, self.rows.query_start_loc)
            self.features = self._check_first(query, cache, None)
        r = self.rows
        if not (first and isinstance(self.backend, RunnerBackend)):
            return into(out, self.backend.prefill_attention(
                query, cache, r.query_start_loc, self.settings.scale, r.max_query_len, r.max_seq_len, self.window,
                self.features, plan=self.plan,
            ))
        plan = self.backend.prefill_launches(query, cache, r.query_start_loc, self.settings.scale, r.max_query_len,
                                             self.window, self.features)
        return self._run_first(plan, query, key_cache, value_cache, k_scale, v_scale, out)


class CacheWrite:
    """`paged.kernels.reshape_and_cache` of one step's new K/V at `slot_mapping` (-1: skipped)."""

    def __init__(self, slot_mapping: torch.Tensor, host_slot_mapping: np.ndarray, backend: str | KernelBackend,
                 num_slots: int) -> None:
        self.has_padding = step_checks.check_slots(host_slot_mapping, num_slots)
        self.slot_mapping = slot_mapping
        self.backend = get_backend(backend)
        self.checked = False
        self.layer_launches: _LayerLaunches | None = None

    def __call__(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """On a backend that runs `Launch`es the first layer's launch serves the later layers, as the
        decode's does (`_LayerLaunches`)."""
        roles = (key, value, key_cache, value_cache, k_scale, v_scale)
        if self.layer_launches is not None and self.layer_launches.run(roles):
            return
        if not self.checked:
            head_size, block_size = input_checks.check_reshape_and_cache(key, value, key_cache, value_cache,
                                                                         self.slot_mapping)
            check_planned_scales(key_cache, k_scale, v_scale)
            self.backend = serving_backend(self.backend, key, head_size, block_size, cache_dtype=key_cache.dtype)
            self.checked = True
            if isinstance(self.backend, RunnerBackend):
                plan = self.backend.cache_write_launches(key, value, key_cache, value_cache, self.slot_mapping,
                                                         k_scale, v_scale)
                if plan is not None:
                    plan.runner.run(plan.unit, plan.launches)
                    self.layer_launches = _LayerLaunches.of(plan, roles)
                return
        self.backend.reshape_and_cache(key, value, key_cache, value_cache, self.slot_mapping, k_scale, v_scale,
                                       has_padding=self.has_padding)
