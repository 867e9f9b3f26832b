"""What `LLM(model, **kwargs)` means as config overrides: the model, named by a config name, a local
Hugging Face checkpoint directory or a GGUF file, and vLLM's common engine keyword arguments, each
mapped to the config key that does the same here (docs/running.md lists them).

Values are checked here, so that a wrong one fails in one line before anything loads; ranges are
left to the config's own checks (`paged.config.validate`), which name the config key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged.config import CONF_DIR, ConfigError, compose_config
from paged.config.choices import DTYPE_NAMES, KV_CACHE_DTYPES

# vLLM's dtype names: "half" and "float" are torch's aliases
_DTYPES = {"auto": "auto", "float": "float32", "half": "float16", **{name: name for name in DTYPE_NAMES}}
# vLLM's "fp8" is its e4m3 format
_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", **{name: name for name in KV_CACHE_DTYPES}}
# the model group option that loads any GGUF file given as model.path
_GGUF_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EngineArgs:
    """vLLM's `LLM(...)` keyword arguments that this engine honours; None: the config's own value.

    `trust_remote_code` does nothing: the architectures are implemented here and no checkpoint code
    is ever run. `tokenizer` may only name the model itself: its own tokenizer is always used.
    `enforce_eager=True` turns CUDA graphs off (`executor.cuda_graphs=false`); on a CPU, or with
    executor=sim, nothing runs from graphs anyway."""

    max_model_len: int | None = None  # scheduler.max_model_len
    gpu_memory_utilization: float | None = None  # allocator.gpu_memory_utilization
    dtype: str | torch.dtype | None = None  # model.dtype
    seed: int | None = None  # seed
    max_num_seqs: int | None = None  # scheduler.max_num_seqs
    max_num_batched_tokens: int | None = None  # scheduler.max_num_batched_tokens
    block_size: int | None = None  # allocator.block_size
    swap_space: float | None = None  # allocator.swap_space, in GiB as vLLM gives it
    enable_prefix_caching: bool | None = None  # allocator=prefix (True) / naive (False)
    enable_chunked_prefill: bool | None = None  # scheduler.chunked_prefill
    kv_cache_dtype: str | None = None  # kernel.kv_cache_dtype
    tensor_parallel_size: int = 1  # executor.tensor_parallel_size; executor=sim: hardware.num_gpus
    pipeline_parallel_size: int = 1
    tokenizer: str | None = None
    trust_remote_code: bool = False
    enforce_eager: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], own: Sequence[str] = ()) -> EngineArgs:
        """The arguments `kwargs` give; an unknown name raises TypeError, as Python's own call does,
        with the closest accepted name (`own`: the caller's other keyword arguments) and the list."""
        fields = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in fields:
                accepted = sorted([*own, *fields])
                close = difflib.get_close_matches(name, accepted, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"LLM() got an unexpected keyword argument {name!r}{hint} (accepted: {', '.join(accepted)})"
                )
        return cls(**kwargs)

    def overrides(self, allocator: str | None) -> list[str]:
        """Config overrides for these arguments and the `allocator` option the caller named (None:
        the one `enable_prefix_caching` implies, prefix by default)."""
        out = [f"allocator={self._allocator(allocator)}"]
        for key, name in (
            ("scheduler.max_model_len", "max_model_len"),
            ("scheduler.max_num_seqs", "max_num_seqs"),
            ("scheduler.max_num_batched_tokens", "max_num_batched_tokens"),
            ("allocator.block_size", "block_size"),
            ("seed", "seed"),
        ):
            if (value := getattr(self, name)) is not None:
                out.append(f"{key}={_integer(name, value)}")
        if self.gpu_memory_utilization is not None:
            utilization = _number("gpu_memory_utilization", self.gpu_memory_utilization)
            out.append(f"allocator.gpu_memory_utilization={utilization}")
        if self.dtype is not None:
            out.append(f"model.dtype={_dtype(self.dtype)}")
        if self.swap_space is not None and _number("swap_space", self.swap_space) > 0:
            out.append(f"allocator.swap_space={self.swap_space}GiB")
        if self.enable_chunked_prefill is not None:
            out.append(f"scheduler.chunked_prefill={_flag('enable_chunked_prefill', self.enable_chunked_prefill)}")
        if self.kv_cache_dtype is not None:
            out.append(f"kernel.kv_cache_dtype={_choice('kv_cache_dtype', self.kv_cache_dtype, _KV_CACHE_DTYPES)}")
        if _integer("tensor_parallel_size", self.tensor_parallel_size) > 1:
            out.append(f"hardware.num_gpus={self.tensor_parallel_size}")
        if _integer("pipeline_parallel_size", self.pipeline_parallel_size) != 1:
            raise ConfigError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: the model runs in "
                "one stage; use pipeline_parallel_size=1"
            )
        _flag("trust_remote_code", self.trust_remote_code)
        _flag("enforce_eager", self.enforce_eager)
        return out

    def check_tokenizer(self, model: str | os.PathLike[str]) -> None:
        if self.tokenizer is not None and str(self.tokenizer) != str(model):
            raise ConfigError(
                f"tokenizer={self.tokenizer!r}: a separate tokenizer is not supported; the model's own (from "
                "its checkpoint) is used, so leave tokenizer out"
            )

    def apply(self, cfg: Any) -> None:
        """What depends on the composed config: the executor it chose, the preemption mode."""
        if self.tensor_parallel_size > 1 and "tensor_parallel_size" in cfg.executor:
            cfg.executor.tensor_parallel_size = self.tensor_parallel_size
        elif self.tensor_parallel_size > 1 and cfg.executor.name != "sim":
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported by executor={cfg.executor.name}: "
                "it has no executor.tensor_parallel_size; use tensor_parallel_size=1"
            )
        if self.swap_space == 0 and cfg.scheduler.preemption_mode != "recompute":
            raise ConfigError(
                f"swap_space=0 leaves no CPU swap pool, but scheduler.preemption_mode={cfg.scheduler.preemption_mode} "
                "swaps; give swap_space > 0 (GiB) or use scheduler.preemption_mode=recompute"
            )
        if self.enforce_eager and "cuda_graphs" in cfg.executor:
            cfg.executor.cuda_graphs = False

    def _allocator(self, allocator: str | None) -> str:
        enable = self.enable_prefix_caching
        if enable is None:
            return allocator or "prefix"
        _flag("enable_prefix_caching", enable)
        if allocator is None:
            return "prefix" if enable else "naive"
        if enable != (allocator == "prefix"):
            raise ConfigError(
                f"enable_prefix_caching={enable} contradicts allocator={allocator!r} (only allocator=prefix caches "
                "prefixes); give one of them"
            )
        return allocator


def llm_config(
    model: str | os.PathLike[str],
    *,
    allocator: str | None = None,
    scheduler: str = "fcfs",
    kernel: str = "auto",
    overrides: Sequence[str] = (),
    engine_args: EngineArgs | None = None,
) -> Any:
    """The config `LLM(model, allocator=..., ..., **engine_args)` runs: the model's and the engine
    arguments' overrides, the chosen options, then `overrides` (so they win); builds nothing."""
    args = engine_args or EngineArgs()
    args.check_tokenizer(model)
    cfg = compose_config([
        *model_overrides(model), *args.overrides(allocator), f"scheduler={scheduler}", f"kernel={kernel}",
        "logger=none", "progress=false", *overrides,
    ])
    args.apply(cfg)
    return cfg


def model_overrides(model: str | os.PathLike[str]) -> list[str]:
    """The overrides that select `model`: a config model name (conf/model/*.yaml), a local Hugging
    Face checkpoint directory (config.json and *.safetensors) or a GGUF file. Nothing is downloaded."""
    names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    if isinstance(model, str) and model in names:
        return [f"model={model}"]
    if not isinstance(model, str | os.PathLike):
        raise ConfigError(f"model must be a config model name or a path, got {type(model).__name__} {model!r}")
    path = Path(model).expanduser()
    location = f"model.path={_quoted(str(path.resolve()))}"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={str(model)!r} is a directory without config.json: not a Hugging Face checkpoint")
        return ["model=hf", location, f"model.name={_quoted(path.name)}"]
    if path.is_file() and path.suffix == ".gguf":
        return [f"model={_GGUF_MODEL}", location, f"model.name={_quoted(path.stem)}"]
    close = difflib.get_close_matches(str(model), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(
        f"model={str(model)!r} is not a config model name, a local Hugging Face checkpoint directory (with "
        f"config.json) or a .gguf file; {hint}config names: {', '.join(names)} (a hub id is not downloaded)"
    )


def _quoted(value: str) -> str:
    """`value` as a quoted Hydra override value (a path may hold spaces, commas, '=' and quotes):
    a quote, and backslashes before a quote or the end, are escaped."""
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), value)
    return f"'{escaped}'"


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


def _flag(name: str, value: object) -> str:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return str(value).lower()


def _dtype(value: str | torch.dtype) -> str:
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return _choice("dtype", name, _DTYPES)


def _choice(name: str, value: object, allowed: dict[str, str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; allowed: {', '.join(allowed)}")
    return allowed[value]
