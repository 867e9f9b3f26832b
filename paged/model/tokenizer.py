"""Text <-> token ids through a transformers tokenizer read from a GGUF file or an HF directory.

Building a tokenizer from GGUF metadata takes ~10 s (transformers converts the BPE vocabulary in
Python), so the converted tokenizer is saved once under the user cache dir and reloaded from there
(~0.3 s); within a process it is loaded once per path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from paged.model.checkpoint_check import CheckpointError, check_tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """`$PAGED_CACHE_DIR`, else `$XDG_CACHE_HOME/paged`, else `~/.cache/paged`."""
    if os.environ.get("PAGED_CACHE_DIR"):
        return Path(os.environ["PAGED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paged"


def _gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    digest = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{gguf.stem}-{digest}"


@functools.lru_cache(maxsize=8)
def load_hf_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The transformers tokenizer of a `.gguf` file or an HF checkpoint directory."""
    # imported here: a simulated run never tokenizes, and transformers costs ~1 s of start-up
    from transformers import AutoTokenizer

    path = Path(source)
    if path.suffix != ".gguf":
        return _directory_tokenizer(path)
    cached = cache_dir() / "tokenizers" / _gguf_cache_key(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Save beside the target and rename, so a concurrent process never reads a half-written copy.
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
        tok.save_pretrained(tmp)
        tmp.rename(cached)
    except OSError as e:  # a read-only home or a lost race: the cache is only an optimisation
        log.debug("tokenizer cache not written to %s: %s", cached, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _directory_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    check_tokenizer_files(directory)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:
        # transformers and tokenizers raise ValueError, OSError, ImportError, KeyError or a bare
        # Exception for a broken tokenizer, over several lines: each becomes one line naming the directory
        reason = " ".join(str(e).split())
        raise CheckpointError(f"the tokenizer in {directory} could not be loaded: {reason}") from e


class Tokenizer:
    """Prompt encoding (optionally through the model's chat template) and output decoding."""

    def __init__(self, hf: PreTrainedTokenizerBase, chat_template: bool = False) -> None:
        if chat_template and not hf.chat_template:
            raise ValueError("model.chat_template=true but this tokenizer has no chat template")
        self.hf = hf
        self.chat_template = chat_template
        self.eos_token_id: int | None = hf.eos_token_id
        self.vocab_size = len(hf)

    def encode(self, prompt: str) -> list[int]:
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}]
            return list(self.hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        return self.hf.encode(prompt)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(source: str | Path, chat_template: bool = False) -> Tokenizer:
    return Tokenizer(load_hf_tokenizer(str(source)), chat_template)
