"""Chained content hashes of full KV blocks: equal hashes mean equal tokens over the whole prefix."""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

from paged.request import Request

# Stands in for the parent digest of a first block; a constant keeps hashes reproducible across runs.
NONE_HASH: bytes = xxhash.xxh3_128_digest(b"paged:none")
_LITTLE_ENDIAN = sys.byteorder == "little"


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra_key: str | None = None) -> bytes:
    """128-bit xxh3 of (parent digest, token count, int64 LE tokens, optional extra key).

    The token count makes the encoding unambiguous, so an extra key can never pass for tokens.
    """
    n = len(token_ids)
    data = (parent if parent is not None else NONE_HASH) + _packer(n)(n, *token_ids)
    if extra_key is not None:
        data += b"\x01" + extra_key.encode()
    return xxhash.xxh3_128_digest(data)


@functools.cache
def _packer(n: int) -> Callable[..., bytes]:
    """The packing of a block of `n` tokens and its count: the format compiled once per block size."""
    return struct.Struct(f"<{n + 1}q").pack


def extend_chain(chain: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int,
                 salt: str | None = None) -> list[bytes]:
    """Extend `chain`, the first hashes of `token_ids`' blocks, to `num_blocks`: `block_hash` of each
    block in turn, to the byte, but with the tokens packed as int64 LE once for all of them (one
    conversion instead of one `struct.pack` of a block's ints per block: the prompt's whole chain at
    admission and in a router). `salt` keys the first block only."""
    start = len(chain)
    if num_blocks <= start:
        return chain
    if num_blocks - start == 1 or not _LITTLE_ENDIAN:
        for i in range(start, num_blocks):
            chain.append(block_hash(chain[-1] if chain else None, token_ids[i * block_size : (i + 1) * block_size],
                                    None if chain else salt))
        return chain
    packed = array("q", token_ids[start * block_size : num_blocks * block_size]).tobytes()
    count, width = struct.pack("<q", block_size), 8 * block_size
    digest = xxhash.xxh3_128_digest
    parent = chain[-1] if chain else NONE_HASH
    for j in range(num_blocks - start):
        data = parent + count + packed[j * width : (j + 1) * width]
        if not chain and salt is not None:
            data += b"\x01" + salt.encode()
        chain.append(parent := digest(data))
    return chain


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, as the prefix cache keys them (the salt
    keys the first block; chaining carries it to every later one)."""
    return extend_chain([], token_ids, block_size, len(token_ids) // block_size, salt)


def request_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """`prompt_block_hashes` of `request`'s prompt and salt, computed once per request and block size
    and kept on it (`Request.prompt_hashes`; `Request.follow`, which changes the prompt, drops it):
    a router and the prefix index of the replica it picks hash the same prompt. Not to be changed."""
    held = request.prompt_hashes
    if held is not None and held[0] == block_size:
        return held[1]
    chain = prompt_block_hashes(request.prompt_token_ids, block_size, request.cache_salt)
    request.prompt_hashes = (block_size, chain)
    return chain
