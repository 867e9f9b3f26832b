"""What the kernels support, defined once.

Backends declare their support from these; the values a config key allows (versions, dtypes,
block sizes, the default partition size) are `paged.config.choices`', re-exported here.
"""

from __future__ import annotations

from paged.config.choices import BLOCK_SIZES, DEFAULT_PARTITION_SIZE, DTYPE_NAMES, VERSIONS

__all__ = [
    "BLOCK_SIZES", "DEFAULT_PARTITION_SIZE", "DTYPE_NAMES", "NATIVE_HEAD_SIZES", "NATIVE_PARTITION_SIZES", "VERSIONS",
]

# Head sizes the CUDA kernels (and so the emulator) are instantiated for.
NATIVE_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
# v2 partitions of the CUDA kernels: whole blocks of every block size, logits in 4 KB of shared
# memory at most.
NATIVE_PARTITION_SIZES = (32, 64, 128, 256, 512, 1024)
