"""A prompt's token ids are checked against the vocabulary at intake: in bulk when the request was held
compactly (`Request.packed_prompt`), one by one from the list otherwise, with the same answer."""

from __future__ import annotations

import pytest

from paged.request import Request, SamplingParams
from paged.scheduler.rejection import _out_of_vocabulary

VOCAB = 1000


@pytest.mark.parametrize("bad", [None, -1, VOCAB, 2**31 - 1])
def test_a_packed_prompt_is_checked_as_its_list_is(bad):
    prompt = [5, 999, 0, 17] + ([] if bad is None else [bad]) + [3]
    plain = Request("plain", prompt, SamplingParams())
    held = Request("held", prompt, SamplingParams())
    held.compact()
    held.expand()
    assert held.packed_prompt is not None and held.prompt_token_ids == prompt
    expected = None if bad is None else (f"prompt token id {bad} (position 4) is outside the model's vocabulary "
                                         f"[0, {VOCAB})")
    assert _out_of_vocabulary(plain, VOCAB) == _out_of_vocabulary(held, VOCAB) == expected


def test_the_packed_prompt_goes_with_the_prompt_it_packs():
    request = Request("r", [1, 2, 3], SamplingParams())
    request.compact()
    request.expand()
    packed = request.packed_prompt
    request.seqs[0].token_ids += [7, 8]
    request.compact()  # the packed prompt copied, the outputs converted
    assert request.packed_prompt is None and packed.tolist() == [1, 2, 3]
    assert request.seqs[0].token_ids.tolist() == [1, 2, 3, 7, 8] and request.prompt_token_ids.tolist() == [1, 2, 3]
