"""A prompt's chain of block hashes is computed once per request (`request_block_hashes`) and shared by
a router and the prefix index; hashed in bulk (`extend_chain`), every hash is `block_hash`'s to the
byte. A changed prompt (`Request.follow`) hashes again; a finished sequence takes its request's
chain with it."""

from __future__ import annotations

import random
import struct
from array import array

import pytest
import xxhash

from paged.memory import PrefixCachingAllocator
from paged.memory.hashing import NONE_HASH, block_hash, extend_chain, prompt_block_hashes, request_block_hashes
from paged.memory.prefix_index import PrefixIndex
from paged.request import FollowUp, Request, SamplingParams


def _reference(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The encoding spelled out: (parent digest, token count, int64 LE tokens, 0x01 and the salt)."""
    chain: list[bytes] = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = (chain[-1] if chain else NONE_HASH) + struct.pack(f"<q{len(block)}q", len(block), *block)
        if salt is not None and not chain:
            data += b"\x01" + salt.encode()
        chain.append(xxhash.xxh3_128_digest(data))
        assert chain[-1] == block_hash(chain[-2] if i else None, block, None if i else salt)
    return chain


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_bulk_chain_is_block_hash_to_the_byte(block_size, salt):
    rng = random.Random(block_size)
    tokens = [rng.randrange(-5, 2**40) for _ in range(203)]
    expected = _reference(tokens, block_size, salt)
    assert prompt_block_hashes(tokens, block_size, salt) == expected
    assert prompt_block_hashes(array("q", tokens), block_size, salt) == expected
    # extended from any prefix of the chain, in steps of any size (one block: the per-block path)
    for start in (0, 1, 5):
        chain = expected[:start]
        for stop in (start + 1, start + 3, len(expected)):
            extend_chain(chain, tokens, block_size, stop, salt)
            assert chain == expected[:stop]
    assert prompt_block_hashes(tokens[: block_size - 1], block_size, salt) == []


def _request(tokens: list[int], salt: str | None = None, follows: FollowUp | None = None) -> Request:
    return Request(f"r{len(tokens)}", tokens, SamplingParams(max_tokens=4), cache_salt=salt, follows=follows)


def test_the_request_chain_is_the_routers_and_the_index_s():
    tokens = list(range(100, 170))
    request = _request(tokens, salt="s")
    chain = request_block_hashes(request, 16)
    assert chain == prompt_block_hashes(tokens, 16, "s") == _reference(tokens, 16, "s")
    assert request_block_hashes(request, 16) is chain  # computed once
    assert request_block_hashes(request, 8) == _reference(tokens, 8, "s")  # another block size hashes again
    index = PrefixIndex(PrefixCachingAllocator(64, 16))
    seq = request.seqs[0]
    seq.token_ids += [7] * 30  # outputs: the sequence's chain goes past the prompt's
    assert index._chain(seq, 6) == _reference(seq.token_ids, 16, "s")
    assert request_block_hashes(request, 16) == _reference(tokens, 16, "s")  # the request's is not extended
    index.forget(seq)
    assert request.prompt_hashes is None


def test_a_follow_up_hashes_its_new_prompt():
    parent = _request(list(range(40)))
    parent.seqs[0].token_ids += [3, 4, 5]
    parent.finish_time = 1.0
    parent.completions = [parent.seqs[0].completion()]
    child = _request(list(range(500, 520)), follows=FollowUp(parent.request_id))
    stale = request_block_hashes(child, 4)
    child.follow(parent)
    assert child.prompt_hashes is None
    expected = _reference([*range(40), 3, 4, 5, *range(500, 520)], 4)
    assert request_block_hashes(child, 4) == expected != stale
    index = PrefixIndex(PrefixCachingAllocator(64, 4))
    assert index._chain(child.seqs[0], len(expected)) == expected
