"""How a model's layers share KV block tables: one group per attention type (vLLM's hybrid allocator
idea, our own layout).

A model that mixes sliding-window and full-attention layers (Gemma-2/3, Qwen2 with
`max_window_layers`, Ministral) wastes memory with one block table for every layer: the windowed
layers never read a block again once it leaves the window, yet it stays allocated as long as the
full-attention layers need it. With groups, each attention type's layers have their own block table,
so a windowed group frees what leaves its window while a full group keeps its blocks.

All groups draw from one pool of blocks, so memory moves between them as the workload asks. For a
pool block to mean the same bytes whatever group holds it, every group has the same number of
layers, `num_slots`: the smallest type's layer count (vLLM's rule); a larger type is split into
several groups of that size, the last one padded (its unused slots are the price of one pool). The
executor allocates `num_slots` KV tensors, each of `num_blocks` blocks, and layer `l` reads and
writes tensor `slot_of_layer[l]` through the tables of group `group_of_layer[l]`.

`single` is one group of every layer (today's layout): per-layer windows are then applied by the
attention kernels only, and blocks are freed by the window only if every layer has the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KV_GROUP_MODES = ("auto", "single")


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV one block table addresses; `window` in tokens, None for full attention."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    num_slots: int  # KV tensors per pool block: the layers one pool block holds
    slot_of_layer: tuple[int, ...]
    group_of_layer: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def full_groups(self) -> tuple[int, ...]:
        """The groups of full-attention layers, in order: those a KV press compresses (a windowed
        group frees blocks by its window already)."""
        return tuple(g for g, group in enumerate(self.groups) if group.window is None)

    @classmethod
    def build(cls, layer_windows: Sequence[int | None], mode: str = "auto") -> KVLayout:
        """The layout of a model whose layer `l` attends `layer_windows[l]` tokens (None: all)."""
        if mode not in KV_GROUP_MODES:
            raise ValueError(f"allocator.kv_groups={mode!r} is not supported; allowed: {', '.join(KV_GROUP_MODES)}")
        num_layers = len(layer_windows)
        if num_layers == 0:
            raise ValueError("a model needs at least one layer")
        windows = list(dict.fromkeys(layer_windows))  # the attention types, in order of first layer
        if mode == "single" or len(windows) == 1:
            window = windows[0] if len(windows) == 1 else None
            group = KVGroup(window, tuple(range(num_layers)))
            return cls((group,), num_layers, tuple(range(num_layers)), (0,) * num_layers)
        by_type = {w: [layer for layer, lw in enumerate(layer_windows) if lw == w] for w in windows}
        size = min(len(layers) for layers in by_type.values())
        groups: list[KVGroup] = []
        slot_of_layer = [0] * num_layers
        group_of_layer = [0] * num_layers
        for window, layers in by_type.items():
            for start in range(0, len(layers), size):
                chunk = tuple(layers[start : start + size])
                for slot, layer in enumerate(chunk):
                    slot_of_layer[layer] = slot
                    group_of_layer[layer] = len(groups)
                groups.append(KVGroup(window, chunk))
        return cls(tuple(groups), size, tuple(slot_of_layer), tuple(group_of_layer))
