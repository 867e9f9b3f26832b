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


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, as the prefix cache keys them (the salt
    keys the first block; chaining carries it to every later one)."""
    chain: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        chain.append(block_hash(chain[-1] if chain else None, token_ids[i * block_size : (i + 1) * block_size],
                                None if chain else salt))
    return chain
