"""`load_tokenizer` reads plain fast tokenizers (the shipped SmolLM2 one, a GGUF's once converted) with
the `tokenizers` library alone, without importing transformers; the ids, text, EOS and vocabulary are
transformers' own, and whatever transformers would change (a chat template, a class or setting that
alters encoding or decoding, unreadable files) still goes through transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.model.checkpoint_check import CheckpointError
from paged.model.locate import locate_smollm2, shipped_tokenizer
from paged.model.tokenizer import FileTokenizer, Tokenizer, load_hf_tokenizer, load_tokenizer
from tests.hypothesis_budget import examples

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "What is the capital of France?",
    "héllo wörld, 你好 🙂\n\n  two spaces\tand a tab",
    "<|im_start|>user\nspecial tokens in the text<|im_end|><|endoftext|>",
    " a , b . c ' d n't  (spaces before punctuation stay)",
    "",
]


@pytest.fixture(scope="module", params=["shipped", "gguf"])
def pair(request: pytest.FixtureRequest) -> tuple[FileTokenizer, object]:
    source = shipped_tokenizer() if request.param == "shipped" else locate_smollm2()
    hf = load_hf_tokenizer(str(source))  # for a GGUF, this also writes the converted files it reads
    ours = load_tokenizer(source)
    assert isinstance(ours, FileTokenizer)
    return ours, hf


def test_ids_text_eos_and_vocabulary_are_transformers(pair: tuple[FileTokenizer, object]) -> None:
    ours, hf = pair
    assert (ours.eos_token_id, ours.pad_token_id, ours.vocab_size) == (hf.eos_token_id, hf.pad_token_id, len(hf))
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=examples(100), deadline=None)
@given(text=st.text(max_size=80), ids=st.lists(st.integers(0, 49151), max_size=40))
def test_any_text_and_any_ids_as_transformers(text: str, ids: list[int]) -> None:
    ours, hf = load_tokenizer(shipped_tokenizer()), load_hf_tokenizer(str(shipped_tokenizer()))
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_a_chat_template_goes_through_transformers() -> None:
    tok = load_tokenizer(shipped_tokenizer(), chat_template=True)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("hi")[:1] == [tok.hf.convert_tokens_to_ids("<|im_start|>")]


def test_the_transformers_tokenizer_of_the_same_files_is_there_when_asked_for() -> None:
    """What `LLM.get_tokenizer()` returns (vLLM returns an HF tokenizer too) and renders chats with."""
    tok = load_tokenizer(shipped_tokenizer())
    assert isinstance(tok, FileTokenizer) and tok.hf is load_hf_tokenizer(str(shipped_tokenizer()))
    assert tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def _copy_with(tmp_path: Path, **config: object) -> Path:
    directory = tmp_path / "tok"
    shutil.copytree(shipped_tokenizer(), directory)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


@pytest.mark.parametrize("config", [
    {"tokenizer_class": "LlamaTokenizerFast"},
    {"clean_up_tokenization_spaces": True},
    {"add_bos_token": True},
    {"added_tokens_decoder": {"49152": {"content": "<|not in tokenizer.json|>", "special": True}}},
], ids=["class", "clean-up", "bos", "added-token"])
def test_what_transformers_would_change_goes_through_transformers(tmp_path: Path, config: dict) -> None:
    assert isinstance(load_tokenizer(_copy_with(tmp_path, **config)), Tokenizer)


def test_a_broken_tokenizer_json_is_transformers_one_line_error(tmp_path: Path) -> None:
    directory = _copy_with(tmp_path)
    (directory / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="could not be loaded"):
        load_tokenizer(directory)


@pytest.mark.subprocess
def test_reading_the_shipped_tokenizer_imports_no_transformers() -> None:
    code = ("import sys; from paged.model.tokenizer import load_tokenizer; from paged.model.locate import "
            "shipped_tokenizer; t = load_tokenizer(shipped_tokenizer()); assert t.encode('hi'); "
            "print('transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
