"""`IncrementalDetokenizer` on the real SmolLM2 tokenizer (byte-level BPE): the text grown one token
at a time equals a full decode, and stop strings are found across token boundaries.

The tokenizer only is loaded (from the user cache, ~0.3 s), never the model: the "real generations"
below are SmolLM2-135M-Instruct's outputs for chat-formatted prompts (greedy, the poem sampled),
recorded once, so the test stays fast.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from paged.model.locate import INSTALL_HINT, locate_smollm2
from paged.model.tokenizer import Tokenizer, load_tokenizer
from tests.hypothesis_budget import examples

EOS = 2  # <|im_end|>
SPECIAL_IDS = [0, 1, 2, 3]  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>

# (chat prompt, generated ids)
GENERATIONS = [
    ("What is the capital of France?", [504, 3575, 282, 4649, 314, 7042, 30, EOS]),
    (
        "Write a short poem with emoji about the sea.",
        [504, 3426, 314, 253, 26156, 28, 253, 35997, 28, 253, 45681, 17, 378, 5065, 314, 253, 26037, 282, 5631,
         10094, 28, 253, 26156, 282, 4461, 28, 284, 253, 45681, 282, 2382, 17, 657, 314, 253, 14640, 10420, 28, 253,
         26156, 282, 2606, 28, 284, 253, 45681, 282, 13735],
    ),
    (  # 'わら・・・…': every character split over two byte tokens
        "Translate 'good morning' into Japanese, Chinese and Russian.",
        [10391, 233, 10391, 227, *[11100, 136] * 22],
    ),
    (
        "Write a Python function that reverses a string.",
        [3725, 5367, 198, 1604, 8535, 79, 5931, 24, 4525, 79, 1321, 727, 472, 1003, 3007, 79, 1321, 43788, 33, 77,
         198, 3725, 198, 198, 1348, 1517, 2925, 36875, 288, 8535, 260, 3007, 4928, 30, 378, 2179, 43788, 33, 77, 80,
         17227, 281, 5905, 314, 253, 17061, 338, 6765],
    ),
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello 😀 world, 日本語 and naïve café! Ünïcödé — “quotes” … 🇫🇷🏳️‍🌈 👩‍👩‍👧",
    "def f(x):\n\treturn x  **  2   # spaces\n\n\n",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. 你好，世界。 こんにちは、世界！",
    "   leading spaces, trailing spaces   ",
]
SENTENCE = CORPUS[0]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    try:
        path = locate_smollm2()
    except FileNotFoundError:
        pytest.skip(f"SmolLM2 weights not installed ({INSTALL_HINT})")
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def corpus_ids(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The encoded corpus and the token indices that fall between two characters."""
    ids = tok.encode("".join(CORPUS))
    boundaries = [i for i in range(len(ids) + 1) if not _splits_a_character(tok, ids, i)]
    assert len(boundaries) < len(ids) + 1  # some character is split over tokens
    return ids, boundaries


def _splits_a_character(tok: Tokenizer, ids: list[int], i: int) -> bool:
    return tok.decode(ids[:i]).endswith("\ufffd") or tok.decode(ids[i:]).startswith("\ufffd")


def detokenize(tok, prompt: list[int], output: list[int], **kwargs) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    for t in output:
        assert detok.append(t) is None
    return detok


def char_end_of_token(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Character offset, in decode(ids), of the end of each token (a character-aligned list)."""
    return [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize(("question", "output"), GENERATIONS, ids=["paris", "poem", "japanese", "python"])
def test_real_generations_equal_full_decode(tok: Tokenizer, question, output, skip_special_tokens: bool) -> None:
    prompt = load_tokenizer(locate_smollm2(), chat_template=True).encode(question)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    for i, t in enumerate(output):
        detok.append(t)
        # Never a U+FFFD of a character still being assembled, never the prompt.
        assert "\ufffd" not in detok.text
        assert tok.decode(output[: i + 1], skip_special_tokens=skip_special_tokens).startswith(detok.text)
    assert detok.text == tok.decode(output, skip_special_tokens=skip_special_tokens)


def test_eos_is_dropped_or_kept(tok: Tokenizer) -> None:
    prompt, output = tok.encode("The capital of France is"), tok.encode(" Paris.") + [EOS]
    assert detokenize(tok, prompt, output).text == " Paris."
    assert detokenize(tok, prompt, output, skip_special_tokens=False).text == " Paris.<|im_end|>"


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_random_slices_of_real_text_equal_full_decode(tok: Tokenizer, corpus_ids, data: st.DataObject) -> None:
    ids, boundaries = corpus_ids
    start, end = sorted(data.draw(st.lists(st.sampled_from(boundaries), min_size=2, max_size=2)))
    output = ids[start:end]
    specials = data.draw(st.lists(st.tuples(st.sampled_from(boundaries), st.sampled_from(SPECIAL_IDS)), max_size=3))
    for at, special in sorted(specials, reverse=True):
        if start <= at <= end:
            output.insert(at - start, special)
    skip = data.draw(st.booleans())
    detok = detokenize(tok, ids[:start], output, skip_special_tokens=skip)
    assert detok.text == tok.decode(output, skip_special_tokens=skip)


def test_character_split_over_byte_tokens_appears_once_complete(tok: Tokenizer) -> None:
    ids = tok.encode("Hello 😀 world, 日本語")
    pieces = [tok.decode([t]) for t in ids]
    assert sum("\ufffd" in p for p in pieces) >= 5  # 😀 over two tokens, 日 and 語 over three each
    detok = IncrementalDetokenizer(tok, [])
    grown = []
    for t in ids:
        detok.append(t)
        grown.append(detok.text)
    assert grown[pieces.index(" \ufffd")] == "Hello"  # the first byte token of 😀 waits
    assert "😀" in grown[pieces.index(" \ufffd") + 1]
    assert not any("\ufffd" in g for g in grown)
    assert detok.text == "Hello 😀 world, 日本語" == tok.decode(ids)


def test_skipped_special_token_inside_a_split_character(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀 ok")
    output = [ids[0], EOS, *ids[1:]]
    assert tok.decode([ids[0]]).endswith("\ufffd")
    assert detokenize(tok, [], output).text == " 😀 ok" == tok.decode(output)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    """The completing bytes belong to the output, so the text is what decode(output) says."""
    ids = tok.encode("Hello 😀 world")
    cut = next(i for i, t in enumerate(ids) if tok.decode([t]).endswith("\ufffd")) + 1
    output = ids[cut:]
    text = detokenize(tok, ids[:cut], output).text
    assert text == tok.decode(output) == "\ufffd world"


def test_prompt_context_keeps_a_word_boundary_space() -> None:
    """SentencePiece-style decoders drop the space of the first word decoded; the prompt tokens given
    as context keep the space of the first output word, as in a decode of prompt and output together."""

    class Metaspace:
        vocab = ["▁The", "▁cat", "▁sat", "."]

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            text = "".join(self.vocab[t] for t in token_ids).replace("▁", " ")
            return text.removeprefix(" ")

    detok = detokenize(Metaspace(), [0], [1, 2, 3])
    assert detok.text == " cat sat."


def test_decodes_only_a_window(tok: Tokenizer) -> None:
    """The cost of a token does not grow with the output: each decode sees a few tokens."""

    class Counting:
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            self.lengths.append(len(token_ids))
            return tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    prompt, output = tok.encode(" ".join(CORPUS)), tok.encode(" ".join(CORPUS) * 4)
    detok = detokenize(counting, prompt, output)
    assert detok.text == tok.decode(output)
    assert len(prompt) > 50 and len(output) > 200
    assert max(counting.lengths) <= PROMPT_CONTEXT_TOKENS + 4


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("stop", "tokens_spanned"), [("rown fo", 2), ("ick brown f", 3), (" fox", 1)])
def test_stop_string_split_across_tokens(tok: Tokenizer, stop: str, tokens_spanned: int, include: bool) -> None:
    ids = tok.encode(SENTENCE)
    ends = char_end_of_token(tok, ids)
    start = SENTENCE.index(stop)
    first = next(i for i, e in enumerate(ends) if e > start)
    last = next(i for i, e in enumerate(ends) if e >= start + len(stop))
    assert last - first + 1 == tokens_spanned
    # Except " fox", the completing token runs on past the stop string, so the cut is inside a token.
    assert (ends[last] > start + len(stop)) == (stop != " fox")

    detok = IncrementalDetokenizer(tok, [], stop=(stop,), include_stop_str_in_output=include)
    for i, t in enumerate(ids):
        hit = detok.append(t)
        if i < last:
            assert hit is None
        else:
            assert hit == stop
            break
    assert i == last
    assert detok.text == SENTENCE[: start + len(stop) if include else start]


def test_stop_strings_across_three_tokens_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("Say it: ")
    output = tok.encode("The quick brown fox jumps")
    detok = IncrementalDetokenizer(tok, prompt, stop=("quick brown fox",))
    hits = [detok.append(t) for t in output[:4]]
    assert hits == [None, None, None, "quick brown fox"]
    assert detok.text == "The "


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("order", [1, -1])
def test_earliest_of_several_stop_strings_wins(tok: Tokenizer, order: int, include: bool) -> None:
    ids = tok.encode(SENTENCE)
    # Both complete on the token " brown"; "ick brown" starts earlier.
    stop = ("brown", "ick brown", "lazy")[::order]
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    hits = [detok.append(t) for t in ids[:3]]
    assert hits == [None, None, "ick brown"]
    assert detok.text == ("The quick brown" if include else "The qu")


def test_same_start_the_shorter_stop_wins(tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(tok, [], stop=("quick", "qu"), include_stop_str_in_output=True)
    assert [detok.append(t) for t in ids[:2]] == [None, "qu"]  # both end inside the token " quick"
    assert detok.text == "The qu"


def test_stop_string_not_in_output_never_stops(tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCE)
    # "capital" is in the prompt only: stop strings look at the output.
    detok = detokenize(tok, tok.encode("What is the capital"), ids, stop=("capital", "cat"))
    assert detok.text == SENTENCE


def test_append_after_stop_raises(tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(tok, [], stop=(" fox",))
    for t in ids[:4]:
        detok.append(t)
    with pytest.raises(RuntimeError, match="fox"):
        detok.append(ids[4])
    assert detok.text == "The quick brown"


def test_empty_stop_string_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=("ok", ""))


def test_fork_mid_character_is_independent(tok: Tokenizer) -> None:
    ids = tok.encode("Hello 😀 world")
    split = next(i for i, t in enumerate(ids) if tok.decode([t]).endswith("\ufffd"))
    parent = detokenize(tok, [], ids[: split + 1])
    assert parent.text == "Hello"
    child = parent.fork()
    other = tok.encode(" 😀 there")[1:]  # the same completing byte, then another word
    for t in ids[split + 1 :]:
        parent.append(t)
    for t in other:
        child.append(t)
    assert parent.text == "Hello 😀 world"
    assert child.text == tok.decode(ids[: split + 1] + other) == "Hello 😀 there"


def test_fork_keeps_a_half_matched_stop_string(tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCE)
    parent = detokenize(tok, [], ids[:3], stop=("rown fo",))  # "The quick brown"
    child = parent.fork()
    assert child.append(ids[3]) == "rown fo"
    assert child.text == "The quick b"
    dog = tok.encode(" dog")
    assert parent.append(dog[0]) is None
    assert parent.text == "The quick brown dog"
    with pytest.raises(RuntimeError):
        child.append(dog[0])


def test_unchecked_appends_skip_a_stop_string_and_a_later_one_still_stops(tok: Tokenizer) -> None:
    # the scheduler does not check stop strings before min_tokens: the first " fox" must not stop,
    # and the tail kept meanwhile still finds a later match
    text = "the fox and the fox"
    ids = tok.encode(text)
    ends = char_end_of_token(tok, ids)
    first_end = text.index(" fox") + len(" fox")
    detok = IncrementalDetokenizer(tok, [], stop=(" fox",))
    hits = [detok.append(t, check_stop=ends[i] > first_end) for i, t in enumerate(ids)]
    assert hits[:-1] == [None] * (len(ids) - 1) and hits[-1] == " fox"
    assert detok.text == "the fox and the"
