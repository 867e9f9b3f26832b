"""The SmolLM2 tokenizer shipped in `paged.data` (what random-weight models tokenize with) is the GGUF's
tokenizer, and `model=tiny-random` runs on a machine without the GGUF."""

from __future__ import annotations

import pytest

from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.model import locate, weights
from paged.model.locate import locate_smollm2, shipped_tokenizer
from paged.model.tokenizer import load_hf_tokenizer

TEXTS = [
    "What is the capital of France?",
    "héllo wörld, 你好 🙂\n\n  two spaces\tand a tab",
    "<|im_start|>user\nspecial tokens in the text<|im_end|><|endoftext|>",
    "def f(x):\n    return x ** 2  # code\n",
    "",
]


def test_the_shipped_tokenizer_is_the_ggufs() -> None:
    ours = load_hf_tokenizer(str(shipped_tokenizer()))
    gguf = load_hf_tokenizer(str(locate_smollm2()))
    assert len(ours) == len(gguf) == 49152
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        gguf.eos_token_id, gguf.bos_token_id, gguf.pad_token_id)
    for text in TEXTS:
        ids = gguf.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == gguf.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == gguf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": TEXTS[0]}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == gguf.apply_chat_template(
        messages, add_generation_prompt=True)


def test_tiny_random_runs_without_the_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise FileNotFoundError("no GGUF on this machine")

    monkeypatch.setattr(locate, "locate_smollm2", missing)
    monkeypatch.setattr(weights, "locate_smollm2", missing)
    executor = ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"),
                             KernelConfig(name="t", backend="torch"))
    ids = executor.tokenizer.encode(TEXTS[0])
    assert ids and executor.tokenizer.decode(ids) == TEXTS[0]
    assert executor.eos_token_ids == {2}
