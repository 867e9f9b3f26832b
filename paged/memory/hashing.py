"""Chained content hashes of full KV blocks: equal hashes mean equal tokens over the whole prefix."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# Stands in for the parent digest of a first block; a constant keeps hashes reproducible across runs.
NONE_HASH: bytes = xxhash.xxh3_128_digest(b"paged:none")


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra_key: str | None = None) -> bytes:
    """128-bit xxh3 of (parent digest, token count, int64 LE tokens, optional extra key).

    The token count makes the encoding unambiguous, so an extra key can never pass for tokens.
    """
    n = len(token_ids)
    data = (parent if parent is not None else NONE_HASH) + struct.pack(f"<q{n}q", n, *token_ids)
    if extra_key is not None:
        data += b"\x01" + extra_key.encode()
    return xxhash.xxh3_128_digest(data)
