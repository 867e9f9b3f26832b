"""KV compression policies (`kv_press`): a small base (`KVPress`) and one file per press."""

from paged.memory.press.block_norm import BlockNormPress
from paged.memory.press.h2o import H2OPress
from paged.memory.press.knorm import KnormPress
from paged.memory.press.kv_press import KVPress, PressView
from paged.memory.press.sink_window import SinkWindowPress
from paged.memory.press.snapkv import SnapKVPress

# the built-in presses by their config name (`kv_press=<name>`); `none` is no press at all
PRESSES: dict[str, type[KVPress]] = {
    cls.name: cls for cls in (SinkWindowPress, SnapKVPress, H2OPress, KnormPress, BlockNormPress)
}

__all__ = [
    "PRESSES", "BlockNormPress", "H2OPress", "KVPress", "KnormPress", "PressView", "SinkWindowPress", "SnapKVPress",
]
