"""The host C++ compiler that builds the emu and cpu backends: `$CXX`, else `g++`, version >= 12
(C++20 `<barrier>` for the emulator, `_Float16` for both), and the cached build both use."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from paged.kernels.toolchain.cache_dir import ArtifactCache, make_key

MIN_VERSION = 12


class CompilerNotFoundError(RuntimeError):
    """No usable host C++ compiler."""


class HostBuildError(RuntimeError):
    """The host compiler rejected a source; the message holds its full output."""


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str


@cache
def find_compiler() -> Compiler:
    wanted = os.environ.get("CXX") or "g++"
    path = shutil.which(wanted)
    if path is None:
        raise CompilerNotFoundError(
            f"the emu and cpu backends need a host C++ compiler (g++ >= {MIN_VERSION}); looked for {wanted!r} "
            "($CXX, else g++) on PATH and found none"
        )
    version = subprocess.run([path, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    major = re.match(r"(\d+)", version)
    if major is None or int(major.group(1)) < MIN_VERSION:
        raise CompilerNotFoundError(
            f"the emu and cpu backends need g++ >= {MIN_VERSION}; {path} reports version {version!r} (set $CXX)"
        )
    return Compiler(path, version)


def unavailable_reason() -> str | None:
    """Why nothing can be built with the host compiler here; `None` when it can."""
    try:
        find_compiler()
    except CompilerNotFoundError as e:
        return str(e)
    return None


def build(
    cache: ArtifactCache, source: str, flags: Sequence[str], *, include_dir: Path, key_parts: Sequence[object] = (),
    prefix_header: Path | None = None,
) -> Path:
    """Compiles C++ `source` text with `flags` into `cache`, or finds it there.

    The key covers the source, the compiler and the flags; `key_parts` adds what else changes the
    output (the headers `source` includes, the CPU that `-march=native` targets). `prefix_header`
    (`-include`) stands for a precompiled header of what `source` includes first: it makes the
    build faster, not different, so the key leaves it out.
    """
    compiler = find_compiler()
    key = make_key(cache.kind, source, compiler.path, compiler.version, list(flags), *key_parts)
    hit = cache.get(key)
    if hit is not None:
        return hit[0]
    with cache.building(key):
        hit = cache.get(key)
        if hit is not None:
            return hit[0]
        unit = cache.temp_path(".cpp")
        unit.write_text(source)
        out = cache.temp_path()
        prefix = ["-include", str(prefix_header)] if prefix_header is not None else []
        cmd = [compiler.path, *flags, *prefix, "-I", str(include_dir), str(unit), "-o", str(out)]
        start = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True)
        unit.unlink()
        if result.returncode != 0:
            out.unlink(missing_ok=True)
            raise HostBuildError(f"{' '.join(cmd)} failed:\n{result.stderr}")
        return cache.put_file(key, out, {"compile_s": time.perf_counter() - start, "command": cmd})
