"""Where the CUDA C++ sources live and the hash that keys every compiled artifact."""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

from paged.utils.assets import asset_dir

MAIN_FILE = "paged.cu"


def source_dir() -> Path:
    """The shipped `kernels_cu/`, or `$PAGED_KERNELS_DIR` to build sources kept elsewhere."""
    override = os.environ.get("PAGED_KERNELS_DIR")
    path = Path(override) if override else asset_dir("kernels_cu")
    if not (path / MAIN_FILE).is_file():
        raise FileNotFoundError(f"kernel sources not found: {path / MAIN_FILE} (set PAGED_KERNELS_DIR)")
    return path


@cache
def _hash_of(path: Path, device_only: bool) -> str:
    digest = hashlib.sha256()
    # cpu/ holds the cpu backend's standalone C++ (keyed by its own hash), not part of paged.cu,
    # except the fp8 conversions the emulator shares; emu/ is what the emulator puts in CUDA's place,
    # which NVRTC never reads (compat.cuh includes it only outside CUDA)
    files = (p for p in path.rglob("*") if p.is_file() and p.suffix in {".cu", ".cuh", ".h", ".cpp"})
    for file in sorted(files):
        top = file.relative_to(path).parts[0]
        if (top == "cpu" and (device_only or file.name != "fp8.h")) or (top == "emu" and device_only):
            continue
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def source_hash() -> str:
    """Content hash of every kernel source file the emulator builds from: an edit anywhere
    invalidates its cached builds."""
    return _hash_of(source_dir(), False)


def device_source_hash() -> str:
    """Content hash of the sources NVRTC reads (all but emu/ and cpu/): an edit to the emulator
    leaves the cubins valid."""
    return _hash_of(source_dir(), True)


def main_source() -> str:
    return (source_dir() / MAIN_FILE).read_text()
