"""Output files written whole or not at all: a temp file in the target's folder, renamed over it.

A full disk, a read-only folder or a kill mid-write leaves the previous file (or none) and no
temp file, never a truncated one; the error names the file. (`atomicwrites` did this, but is
archived; this is the same few lines.)
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any


class OutputError(Exception):
    """An output file could not be written; the message names it and the system's reason."""


@contextmanager
def atomic_open(path: Path | str, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """A file to write `path`'s new content into (`mode` "w" or "wb", `kwargs` as `open`'s); it
    replaces `path` when the block ends without an error. An OSError on the way (creating the
    folder, writing, syncing, renaming) is an OutputError naming `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # os.open rather than tempfile: the file gets the umask's permissions, as a plain open would
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise _error(path, e) from e
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            # on disk before the rename: a crash must not leave a renamed but empty file
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as e:
        with suppress(OSError):  # the first error is the one to report
            temp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _error(path, e) from e
        raise


def write_text(path: Path | str, text: str) -> None:
    """`path.write_text(text)`, atomically."""
    with atomic_open(path) as f:
        f.write(text)


def _error(path: Path, e: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {e.strerror or e}")
