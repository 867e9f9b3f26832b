"""A model's attention types per layer, and what the real executor refuses about them before a run.

Layers of one model may attend differently (Gemma-2/3 and Qwen2's `max_window_layers` mix sliding
and full layers); the executor plans one `AttentionSettings` per type (`LayerTypes`) and routes
each layer to its type, its KV group and its KV tensor (`paged.executor.attention`). What the
kernels or the executor cannot serve is a one-line ConfigError naming the key to change: a layer
type's feature the named backend lacks (soft-capping on the native kernels), and KV groups with
what assumes one block table (CUDA graphs, tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

from paged import kernels
from paged.config import ConfigError
from paged.kernels.features import AttentionFeatures
from paged.kv_layout import KVLayout
from paged.model.arch import LlamaArch


@dataclass(frozen=True)
class LayerTypes:
    """The distinct attention windows of a model's layers (`windows[kind]`, in order of first
    layer) and each layer's kind; the softmax scale and soft-cap are the model's, for every kind."""

    windows: tuple[int | None, ...]
    kind_of_layer: tuple[int, ...]

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> LayerTypes:
        windows = tuple(dict.fromkeys(layer_windows))
        return cls(windows, tuple(windows.index(w) for w in layer_windows))

    @property
    def widest_window(self) -> int | None:
        """The most positions any layer attends (None: all of them)."""
        return None if None in self.windows else max(self.windows)  # type: ignore[type-var]


def check_backend_serves(requested: str, arch: LlamaArch, model_name: str) -> None:
    """A ConfigError, before weights load, when `kernel.backend` names a backend lacking an attention
    feature the model's layers need (soft-capping); `auto` picks one that has it."""
    features = AttentionFeatures(soft_cap=arch.attn_logit_softcapping)
    if requested == "auto" or not features.names:
        return
    lacking = [name for name in features.names if name not in kernels.get_backend(requested).features]
    if lacking:
        allowed = " or ".join(f"kernel.backend={name}" for name in (*kernels.backends_serving(features), "auto"))
        raise ConfigError(f"kernel.backend={requested} cannot serve {model_name}: its layers need attention "
                          f"{', '.join(lacking)} (attn_logit_softcapping={arch.attn_logit_softcapping}), which "
                          f"backend {requested} does not implement; allowed: {allowed}")


def check_kv_layout(layout: KVLayout, layer_windows: tuple[int | None, ...], num_devices: int,
                    cuda_graphs: bool | None) -> None:
    """A ConfigError for a layout of this model that the executor cannot run: one for other layers,
    or several KV groups with tensor parallelism or with `executor.cuda_graphs=true`."""
    if len(layout.slot_of_layer) != len(layer_windows):
        raise ConfigError(f"a KV layout of {len(layout.slot_of_layer)} layers for a model of {len(layer_windows)}")
    if not layout.is_hybrid:
        return
    groups = f"allocator.kv_groups=auto gives this model {layout.num_groups} KV groups"
    if num_devices > 1:
        raise ConfigError(f"{groups}, which executor.tensor_parallel_size={num_devices} does not run; use "
                          "allocator.kv_groups=single or executor.tensor_parallel_size=1")
    if cuda_graphs:
        raise ConfigError(f"{groups}, which executor.cuda_graphs=true does not capture; use "
                          "allocator.kv_groups=single or executor.cuda_graphs=false (or null)")
