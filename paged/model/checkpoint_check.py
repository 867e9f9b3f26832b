"""An HF checkpoint's weights checked against its config.json before they load.

Only the safetensors headers are read (names, shapes, dtypes), so the check costs milliseconds. A
config that disagrees with its weights would otherwise run a different model silently (fewer layers
than stored), or fail deep in the loader with a bare KeyError; each mismatch is named in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from paged.config import ConfigError
from paged.model.arch import LlamaArch
from paged.model.checkpoint_layout import config_key, expected_tensors, ignorable, layer_indices, layer_prefix

log = logging.getLogger(__name__)

# safetensors' dtype names the loader casts to the model's dtype as they are. FP8 is left out:
# such checkpoints carry per-tensor scales that a plain cast would drop.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_LISTED = 3  # names an error message lists before "and N more"
# The files AutoTokenizer builds a tokenizer from; without any, transformers' own error blames a
# missing sentencepiece install, which is not the problem.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class CheckpointError(ConfigError):
    """An HF checkpoint directory whose files cannot be read, or disagree with each other."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I8, ...
    file: str


def read_headers(shards: Iterable[Path]) -> dict[str, TensorInfo]:
    """Each stored tensor's shape, dtype and file, from the safetensors headers only."""
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    tensors[name] = TensorInfo(tuple(piece.get_shape()), piece.get_dtype(), shard.name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    return tensors


def listed(names: Iterable[str]) -> str:
    names = list(names)
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _span(indices: Iterable[int]) -> str:
    ordered = sorted(indices)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{ordered[0]}..{ordered[-1]}"
    return ", ".join(map(str, ordered))


def check_checkpoint(root: Path, arch: LlamaArch, config: dict, tensors: dict[str, TensorInfo]) -> None:
    """CheckpointError naming the first kind of mismatch between config.json (parsed as `config`,
    read as `arch`) and the stored `tensors`: layers, missing tensors, shapes, dtypes, extra tensors."""
    where = f"checkpoint {root}:"
    _check_layers(where, arch, config, tensors)
    expected = expected_tensors(arch, tensors)
    missing = [name for name in expected if name not in tensors]
    if missing:
        why = "config.json says tie_word_embeddings=false" if "lm_head.weight" in missing else (
            f"a {arch.architecture} decoder with this config.json reads them")
        raise CheckpointError(f"{where} missing tensors {listed(missing)} ({why})")
    wrong = [
        f"{name} in {tensors[name].file} has shape {list(tensors[name].shape)} but config.json implies "
        f"{list(want.shape)} ({want.formula})"
        for name, want in expected.items()
        if tensors[name].shape != want.shape
    ]
    if wrong:
        more = f"; {len(wrong) - 1} more tensors mismatch too" if len(wrong) > 1 else ""
        raise CheckpointError(f"{where} {wrong[0]}{more}")
    not_float = [f"{name} ({tensors[name].dtype})" for name in expected if tensors[name].dtype not in FLOAT_DTYPES]
    if not_float:
        raise CheckpointError(
            f"{where} {listed(not_float)}: not a floating-point dtype; the loader reads {', '.join(FLOAT_DTYPES)} "
            "weights only (quantized HF checkpoints are not supported; model=smollm2-135m reads GGUF)"
        )
    extra = [name for name in tensors if name not in expected]
    unused = [name for name in extra if not ignorable(arch, name)]
    if unused:
        raise CheckpointError(
            f"{where} tensors the {arch.architecture} decoder does not read: {listed(unused)}; its output would "
            "differ from the checkpoint's model (does config.json match the weights, e.g. attention_bias / mlp_bias?)"
        )
    if extra:
        log.debug("%s not read (recomputed or tied): %s", root, listed(extra))


def _check_layers(where: str, arch: LlamaArch, config: dict, tensors: dict[str, TensorInfo]) -> None:
    """The layer indices stored against the config's layer count, both ways."""
    held = layer_indices(arch, tensors)
    key = f"{config_key(config, arch.architecture, 'num_layers')}={arch.num_layers}"
    prefix = layer_prefix(arch, tensors)
    beyond = sorted(i for i in held if i >= arch.num_layers)
    if beyond:
        names = listed(f"{prefix}{i}.*" for i in beyond)
        raise CheckpointError(f"{where} config.json says {key} but the weights hold layers {_span(held)} ({names})")
    absent = [i for i in range(arch.num_layers) if i not in held]
    if absent:
        holds = f"layers {_span(held)} only" if held else f"no {prefix}* tensors"
        names = listed(f"{prefix}{i}.*" for i in absent)
        raise CheckpointError(f"{where} config.json says {key} but the weights hold {holds} (no {names})")


def check_tokenizer_files(directory: Path) -> None:
    """CheckpointError unless `directory` holds a tokenizer's files: cheap, so run before the weights
    load (here rather than in `paged.model.tokenizer`, which imports transformers)."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"no tokenizer in {directory} ({' / '.join(TOKENIZER_FILES)} not found); save the model's "
            f"tokenizer there, e.g. AutoTokenizer.from_pretrained(MODEL_ID).save_pretrained('{directory}')"
        )
