"""Text <-> token ids from a GGUF file or an HF directory.

Building a tokenizer from GGUF metadata takes ~10 s (transformers converts the BPE vocabulary in
Python), so the converted tokenizer is saved once under the user cache dir and reloaded from there;
within a process it is loaded once per path. Where the files say transformers would only wrap the
`tokenizers` library (its generic fast class, no decode clean-up) and no chat template is asked for,
the tokenizer is read with `tokenizers` alone: transformers' import costs 1-2.5 s of every start-up
(issue 43), and the ids and text are the same (tests/test_file_tokenizer.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def _gguf_tokenizer_dir(gguf: Path) -> Path:
    """Where the tokenizer converted from `gguf` is saved (it may not be yet)."""
    return cache_dir() / "tokenizers" / _gguf_cache_key(gguf)


@functools.lru_cache(maxsize=8)
def load_hf_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The transformers tokenizer of a `.gguf` file or an HF checkpoint directory."""
    # imported here: a simulated run never tokenizes, and transformers costs ~1 s of start-up
    from transformers import AutoTokenizer

    path = Path(source)
    if path.suffix != ".gguf":
        return _directory_tokenizer(path)
    cached = _gguf_tokenizer_dir(path)
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
        self.pad_token_id: int | None = hf.pad_token_id
        self.vocab_size = len(hf)

    def encode(self, prompt: str) -> list[int]:
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}]
            return list(self.hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        return self.hf.encode(prompt)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)


# transformers' classes that add nothing to the `tokenizers` library's encode and decode (v4 and v5 names),
# and the tokenizer_config.json settings with which they would (each changes the pre-tokenizer,
# post-processor or decoded text)
_PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_CHANGING_SETTINGS = ("clean_up_tokenization_spaces", "add_prefix_space", "add_bos_token", "add_eos_token")


class FileTokenizer:
    """`Tokenizer`'s encode and decode by the `tokenizers` library alone, for files whose
    `tokenizer_config.json` names a plain fast class: what transformers would run. `hf`, the
    transformers tokenizer of the same files (what `LLM.get_tokenizer()` returns, as vLLM's does,
    and what renders chats), is loaded when first asked for."""

    chat_template = False

    def __init__(self, rust: Any, config: dict, source: str) -> None:
        self._rust = rust
        self._source = source
        self.eos_token_id: int | None = self._special_id(config, "eos_token")
        self.pad_token_id: int | None = self._special_id(config, "pad_token")
        self.vocab_size = rust.get_vocab_size(with_added_tokens=True)

    def _special_id(self, config: dict, key: str) -> int | None:
        """The id of the special token `config[key]` names (as text, or as an AddedToken's dict)."""
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return self._rust.token_to_id(token) if token else None

    @functools.cached_property
    def hf(self) -> PreTrainedTokenizerBase:
        return load_hf_tokenizer(self._source)

    @classmethod
    def read(cls, directory: Path, source: str) -> FileTokenizer | None:
        """The tokenizer of `directory` (`source`'s files), or None where transformers would do more
        than `tokenizers` (or the files do not load: transformers then reports them)."""
        from tokenizers import Tokenizer as RustTokenizer

        try:
            config = json.loads((directory / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if config.get("tokenizer_class") not in _PLAIN_FAST_CLASSES or any(config.get(k) for k in _CHANGING_SETTINGS):
            return None
        try:
            rust = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception:  # missing or unreadable; the tokenizers library raises a bare Exception
            return None
        added = [t.get("content") for t in config.get("added_tokens_decoder", {}).values()]
        return None if any(rust.token_to_id(t) is None for t in added) else cls(rust, config, source)

    def encode(self, prompt: str) -> list[int]:
        return self._rust.encode(prompt).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._rust.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _file_tokenizer(source: str) -> FileTokenizer | None:
    path = Path(source)
    directory = _gguf_tokenizer_dir(path) if path.suffix == ".gguf" else path
    # keyed also by whether the files exist: a GGUF's appear once transformers has converted it
    return _read_files(source, str(directory), (directory / "tokenizer_config.json").is_file())


@functools.lru_cache(maxsize=8)
def _read_files(source: str, directory: str, exists: bool) -> FileTokenizer | None:
    return FileTokenizer.read(Path(directory), source) if exists else None


def load_tokenizer(source: str | Path, chat_template: bool = False) -> Tokenizer | FileTokenizer:
    """The tokenizer of a `.gguf` file or an HF directory: from its files alone where that gives
    transformers' result without a chat template, else through transformers."""
    if not chat_template and (fast := _file_tokenizer(str(source))) is not None:
        return fast
    return Tokenizer(load_hf_tokenizer(str(source)), chat_template)
