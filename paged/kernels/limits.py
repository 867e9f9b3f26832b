"""What the kernels support, defined once.

Backends declare their support from these (`backends/base.py`); the config schema takes its
block sizes and default partition size from here.
"""

from __future__ import annotations

VERSIONS = ("v1", "v2")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
BLOCK_SIZES = (8, 16, 32)
# Head sizes the CUDA kernels (and so the emulator) are instantiated for.
NATIVE_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
# v2 partitions of the CUDA kernels: whole blocks of every block size, logits in 4 KB of shared
# memory at most.
NATIVE_PARTITION_SIZES = (32, 64, 128, 256, 512, 1024)
DEFAULT_PARTITION_SIZE = 512
