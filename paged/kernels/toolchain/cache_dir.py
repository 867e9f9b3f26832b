"""On-disk cache of compiled kernels (cubins and emulator libraries).

Each entry is a payload file plus a JSON sidecar holding the payload's SHA-256; an entry whose
sidecar is missing, unreadable or does not match the payload is a miss, so a corrupt file gets
rebuilt instead of loaded. Keys hash everything that changes the output (sources, options,
compiler version, arch), so a stale entry is never looked up. Writes go through a temporary file
and `os.replace`, which keeps concurrent processes from seeing half-written entries. A build holds
the key's lock file (`building`), so processes that miss the same key at once (the test suite's
workers, a sweep's jobs) build it once: the others wait, then find the entry. A build that fails
stores nothing, so the next one to take the lock builds again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV_VAR = "PAGED_CACHE_DIR"
FORMAT = 1


def cache_root() -> Path:
    """`$PAGED_CACHE_DIR`, else `$XDG_CACHE_HOME/paged`, else `~/.cache/paged`."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "paged"


def make_key(*parts: Any) -> str:
    blob = json.dumps([FORMAT, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class ArtifactCache:
    """Entries `<root>/<kind>/<key><suffix>` with their `<key>.json` sidecars."""

    def __init__(self, kind: str, suffix: str) -> None:
        self.kind, self.suffix = kind, suffix

    @property
    def directory(self) -> Path:
        return cache_root() / self.kind

    def payload_path(self, key: str) -> Path:
        return self.directory / f"{key}{self.suffix}"

    def get(self, key: str) -> tuple[Path, dict[str, Any]] | None:
        payload, sidecar = self.payload_path(key), self.directory / f"{key}.json"
        try:
            meta = json.loads(sidecar.read_text())
            if meta.get("sha256") != _sha256(payload):
                return None
        except (OSError, ValueError, AttributeError):
            return None
        return payload, meta

    @contextlib.contextmanager
    def building(self, key: str) -> Iterator[None]:
        """Holds `key`'s lock while the caller builds it; look the key up again inside (another
        process may have built it meanwhile). An unwritable cache builds unlocked: the write fails
        there anyway, and the caller's error says so."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock; the file stays, so a waiter never locks an unlinked one

    def temp_path(self, suffix: str | None = None) -> Path:
        """A fresh path inside the cache directory for a compiler to write into."""
        self.directory.mkdir(parents=True, exist_ok=True)
        suffix = self.suffix if suffix is None else suffix
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=suffix)
        os.close(fd)
        return Path(name)

    def put_file(self, key: str, written: Path, meta: dict[str, Any]) -> Path:
        """Moves `written` (from `temp_path`) into the cache under `key`."""
        payload = self.payload_path(key)
        meta = {**meta, "sha256": _sha256(written)}
        os.replace(written, payload)
        sidecar = self.temp_path(".json")
        sidecar.write_text(json.dumps(meta))
        os.replace(sidecar, self.directory / f"{key}.json")
        return payload

    def put_bytes(self, key: str, data: bytes, meta: dict[str, Any]) -> Path:
        written = self.temp_path()
        written.write_bytes(data)
        return self.put_file(key, written, meta)
