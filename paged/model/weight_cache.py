"""On-disk cache of dequantized GGUF weights.

Turning SmolLM2-135M's Q4_1 GGUF into fp32 tensors takes ~5-7 s (GGUFReader parsing the metadata,
then dequantizing); the result is saved once as safetensors and memory-mapped back by later runs.

An entry is `<cache root>/weights/<sha256 of the GGUF file>-<loader tag>.safetensors`, the cache
root being the kernel cache's (`$PAGED_CACHE_DIR`, else `$XDG_CACHE_HOME/paged`, else
`~/.cache/paged`). The GGUF's content, not its path or mtime, keys it, so an edited or replaced file
never gets stale weights. The loader tag hashes `FORMAT_VERSION`, the gguf package's version and the
source of the code that turns a GGUF into (architecture, tensors), so a changed loader misses, and
writing its entry removes the old loader's entries for the same file. The safetensors header holds
the architecture (so a hit never parses the GGUF) and an xxh3-128 checksum of the tensors; an entry
that fails to parse or to verify is logged and rebuilt. Writes go to a temporary file in the same
directory, then `os.replace`, so a crash or two concurrent runs never leave a half-written entry; a
cache that cannot be written logs a warning and the run goes on uncached.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from paged.kernels.toolchain.cache_dir import cache_root
from paged.model import arch as arch_module
from paged.model import gguf_loader
from paged.model.arch import LlamaArch

log = logging.getLogger(__name__)

# Bump when the entry layout or the meaning of its tensors changes in a way the loader tag misses.
FORMAT_VERSION = 1
SUBDIR = "weights"
_CHUNK = 1 << 20
_STALE_TEMP_S = 3600.0  # a temporary file this old belongs to a writer that died


def cache_dir() -> Path:
    return cache_root() / SUBDIR


def file_sha256(path: str | Path) -> str:
    """SHA-256 of the file's bytes, read 1 MiB at a time (~0.06 s for a 100 MB file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def loader_tag() -> str:
    """12 hex digits naming the code that produced an entry's tensors and architecture."""
    parts: list[str] = [str(FORMAT_VERSION), importlib.metadata.version("gguf")]
    for module in (gguf_loader, arch_module):
        try:
            parts.append(hashlib.sha256(Path(module.__file__ or "").read_bytes()).hexdigest())
        except OSError:
            parts.append(module.__name__)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def entry_path(digest: str) -> Path:
    return cache_dir() / f"{digest}-{loader_tag()}.safetensors"


def tensors_checksum(state: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()


def load_gguf_cached(path: str | Path) -> tuple[LlamaArch, dict[str, torch.Tensor], str]:
    """`gguf_loader.load_gguf(path)` through the cache, and a phrase saying where the weights came from."""
    path = Path(path)
    digest = file_sha256(path)
    entry = entry_path(digest)
    hit = _read(entry, digest)
    if hit is not None:
        return *hit, f"loaded {path.name} from cache {entry}"
    arch, state = gguf_loader.load_gguf(path)
    return arch, state, f"dequantized {path.name}, {_write(entry, digest, path, arch, state)}"


def _read(entry: Path, digest: str) -> tuple[LlamaArch, dict[str, torch.Tensor]] | None:
    """The entry's (architecture, tensors); None when it is absent or does not verify."""
    if not entry.is_file():
        return None
    try:
        # Memory-mapped: ~0.01 s to open, the pages read as the tensors are first touched.
        with safe_open(str(entry), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}
        expected = {"format_version": str(FORMAT_VERSION), "loader": loader_tag(), "source_sha256": digest}
        wrong = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
        if wrong:
            raise ValueError(f"header {wrong} does not match {expected}")
        if meta.get("checksum") != tensors_checksum(state):
            raise ValueError("tensor checksum mismatch")
        return LlamaArch.from_dict(json.loads(meta["arch"])), state
    except Exception as e:  # any unreadable entry is a miss: the cache is only an optimisation
        log.warning("weights: cache entry %s is unreadable (%s: %s); dequantizing again", entry, type(e).__name__, e)
        return None


def _write(entry: Path, digest: str, source: Path, arch: LlamaArch, state: dict[str, torch.Tensor]) -> str:
    """Saves the entry atomically; says where it went, or why it did not."""
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(entry, digest)
        fd, name = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        tmp = Path(name)
        metadata = {
            "format_version": str(FORMAT_VERSION),
            "loader": loader_tag(),
            "source_sha256": digest,
            "source_name": source.name,
            "arch": json.dumps(dataclasses.asdict(arch)),
            "checksum": tensors_checksum(state),
        }
        save_file(state, str(tmp), metadata=metadata)
        os.replace(tmp, entry)
        tmp = None
        return f"cached to {entry}"
    except Exception as e:  # a read-only or full disk, or tensors safetensors refuses
        log.warning("weights: not cached to %s (%s: %s); going on uncached", entry, type(e).__name__, e)
        return "not cached"
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _remove_stale(entry: Path, digest: str) -> None:
    """Other loaders' entries for this GGUF, and temporary files writers left behind when they died."""
    now = time.time()
    for p in entry.parent.iterdir():
        try:
            if p.name.startswith(".tmp-") and now - p.stat().st_mtime > _STALE_TEMP_S:
                p.unlink()
            elif p.name.startswith(f"{digest}-") and p.suffix == ".safetensors" and p != entry:
                p.unlink()
        except OSError:
            pass
