"""Why a request can never run: the reasons it is aborted with rather than left waiting forever.

At intake (`intake_rejection`) its prompt and limits are held against the configuration, then the
block manager's own checks (reservations, allocators). Later the cache itself may refuse it: blocks
to admit its sequences (`allocation_rejection`) or to swap them back in (`swap_in_rejection`) that
the cache cannot give even with nothing else running.
"""

from __future__ import annotations

import numpy as np

from paged.memory import AllocStatus, BlockManager
from paged.request import Request, Sequence


def intake_rejection(
    request: Request, block_manager: BlockManager, *, max_model_len: int, max_num_seqs: int, has_tokenizer: bool,
    vocab_size: int | None = None,
) -> str | None:
    """Why `request` can never run under this configuration; None if it may be queued."""
    if request.abort_reason is not None:
        return request.abort_reason
    params, num_prompt = request.params, request.num_prompt_tokens
    if num_prompt == 0:
        return "empty prompt"
    if vocab_size is not None and (bad := _out_of_vocabulary(request, vocab_size)) is not None:
        return bad
    if num_prompt > max_model_len:
        return f"prompt has {num_prompt} tokens, more than max_model_len={max_model_len}"
    if num_prompt + params.max_tokens > max_model_len:
        # what vLLM's server answers: nothing is silently cut short
        return (
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {num_prompt + params.max_tokens} "
            f"tokens, more than max_model_len={max_model_len}; max_tokens <= {max_model_len - num_prompt} fits"
        )
    if params.best_of > max_num_seqs:
        what = "beam width" if params.use_beam_search else "best_of"
        return f"{what} {params.best_of} needs more sequences than max_num_seqs={max_num_seqs}"
    if params.stop_strings and not has_tokenizer:
        return "stop strings need a tokenizer, and this executor has none (use stop_token_ids)"
    return block_manager.rejection(request)


def _out_of_vocabulary(request: Request, vocab_size: int) -> str | None:
    token_ids, packed = request.prompt_token_ids, request.packed_prompt
    if packed is not None:  # held packed beside its list (`Request.expand`): its bounds read off the buffer
        tokens = np.frombuffer(packed, np.dtype(packed.typecode))
        low, high = int(tokens.min()), int(tokens.max())
    else:
        low, high = min(token_ids), max(token_ids)
    if 0 <= low and high < vocab_size:
        return None
    i, t = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
    return f"prompt token id {t} (position {i}) is outside the model's vocabulary [0, {vocab_size})"


def allocation_rejection(
    block_manager: BlockManager, gang: list[Sequence], status: AllocStatus, *, idle: bool,
) -> str | None:
    """Why `gang` (a request's waiting sequences, admitted together) can never get its blocks, given
    `can_allocate`'s NEVER or LATER; None: it waits for blocks. With nothing running (`idle`)
    nothing will free any, so LATER is never too."""
    bm = block_manager
    required = sum(map(bm.admission_blocks, gang))
    needs = f"needs {required} blocks for {sum(s.num_tokens for s in gang)} tokens but"
    if status is AllocStatus.NEVER and required > bm.allocator.max_allocation < bm.num_total_blocks:
        return (
            f"{needs} the largest contiguous extent the allocator can give is {bm.allocator.max_allocation} blocks"
        )
    if status is AllocStatus.NEVER:
        return f"{needs} the cache has {bm.num_total_blocks} blocks (watermark {bm.watermark_blocks})"
    if idle:
        return (
            f"{needs} with nothing running only {bm.allocator.num_free_blocks} of the cache's "
            f"{bm.num_total_blocks} blocks are free"
        )
    return None


def swap_in_rejection(block_manager: BlockManager, gang: list[Sequence]) -> str:
    """Why `gang` (a request's swapped-out sequences) can never come back: `can_swap_in` said NEVER,
    or LATER with nothing running that would free blocks."""
    needed = sum(map(block_manager.admission_blocks, gang))
    return (
        f"needs {needed} blocks to swap back in; the cache of {block_manager.num_total_blocks} "
        "blocks cannot give them even with nothing running"
    )
