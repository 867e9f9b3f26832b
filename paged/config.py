"""Typed config schemas. Registered in Hydra's ConfigStore so a mistyped key or a wrong type fails
before any model loads; `validate` adds the range checks a type cannot express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from paged.kernels.features import KV_CACHE_DTYPES, BlockSparse, check_scale
from paged.kernels.limits import BLOCK_SIZES, DEFAULT_PARTITION_SIZE, DTYPE_NAMES, VERSIONS
from paged.kernels.registry import BACKENDS
from paged.model.linear import GEMMS


@dataclass
class PluginConfig:
    """A pluggable part: `_target_` is its class's import path, every other key a constructor setting."""

    _target_: str = MISSING


def _plugin(target: str) -> Any:
    return field(default_factory=lambda: PluginConfig(target))


@dataclass
class OptionalPluginConfig:
    """A pluggable part with a built-in default chosen by another key; `_target_` replaces it."""

    _target_: str | None = None


@dataclass
class AllocatorConfig:
    """Core keys; the YAML's other keys are settings of the `_target_` allocator class."""

    name: str = MISSING
    _target_: str = MISSING
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: str | None = None
    # with neither num_blocks nor kv_cache_memory: this share of device memory, less weights and
    # activations, holds the KV cache (vLLM's gpu_memory_utilization)
    gpu_memory_utilization: float = 0.9
    watermark: float = 0.01
    # CPU memory for swapped-out KV (vLLM's --swap-space: 4 GiB per GPU); only allocated when the
    # preemption mode can swap
    swap_space: str = "4GiB"
    # whether forked samples and beams share their parent's blocks (copy-on-write); false is the
    # paper's no-sharing baseline: every block a sequence shares is copied before its next step
    share_blocks: bool = True
    reservation: PluginConfig = _plugin("paged.memory.reservation.ExactReservation")


@dataclass
class SchedulerConfig:
    name: str = MISSING
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    # A step fills its token budget with chunks of prompts, so a prompt longer than the budget runs
    # in several steps and decodes never wait behind a whole prefill (vLLM V1, Sarathi).
    chunked_prefill: bool = True
    # decode-first: running rows, then new prefills in what budget is left (vLLM V1);
    # prefill-first: prefills first (without chunking a step that admits any is prefill-only, vLLM V0)
    batch_order: str = "decode-first"
    # at most this many prompts are left partly computed between steps (vLLM's max_num_partial_prefills)
    max_num_partial_prefills: int = 1
    # a prompt's chunk is at most this many tokens per step; 0: only the budget caps it (vLLM's
    # long_prefill_token_threshold)
    long_prefill_token_threshold: int = 0
    # Among waiting requests whose first uncached block another request is computing right now,
    # admit none: they hit its blocks a step later (SGLang's in-batch prefix de-duplication).
    prefix_dedup: bool = True
    policy: PluginConfig = field(default_factory=PluginConfig)
    # recompute | swap | auto (paged.scheduler.preemption.MODES); `preemption._target_` names a custom mode
    preemption_mode: str = "recompute"
    preemption: OptionalPluginConfig = field(default_factory=OptionalPluginConfig)


@dataclass
class KernelConfig:
    name: str = MISSING
    version: str = "auto"
    backend: str = "auto"
    partition_size: int = DEFAULT_PARTITION_SIZE
    # auto: the model's dtype; fp8_e4m3 / fp8_e5m2 store K/V in one byte with per-head scales
    kv_cache_dtype: str = "auto"
    # fp8 scales (> 0); null: calibrated from the first prefill's K/V (amax / the format's max)
    k_scale: float | None = None
    v_scale: float | None = None
    # vLLM's block-sparse attention: null = dense; else local_blocks, vert_stride, block_size,
    # head_sliding_step. Typed Any: OmegaConf cannot merge a mapping into a typed field whose
    # default is null (omegaconf#1035), which `kernel.blocksparse={...}` on the command line needs.
    blocksparse: Any = None


@dataclass
class ModelConfig:
    name: str = MISSING
    source: str = MISSING
    path: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    chat_template: bool = False
    arch: dict[str, Any] = field(default_factory=dict)
    # Attention window in tokens (Mistral-style); None: the checkpoint's own (none for most models)
    sliding_window: int | None = None
    # The linear layers' kernel (paged.model.linear): auto, torch (F.linear) or onednn (prepacked)
    gemm: str = "auto"
    # source=gguf: reuse the dequantized weights cached on disk (keyed by the file's SHA-256); false: dequantize
    weight_cache: bool = True


@dataclass
class WorkloadConfig:
    name: str = MISSING
    kind: str = MISSING
    path: str | None = None
    num_requests: int | None = 48  # None (trace only): the whole trace
    seed: int = 0
    prompt_len_mean: float = 161.31
    output_len_mean: float = 337.99
    prompt_len_min: int = 4
    prompt_len_max: int | None = 512  # None: only the scheduler's max_model_len limits
    output_len_min: int = 4
    output_len_max: int | None = 256
    prompt_len: int = 512  # kind fixed: every request's exact lengths
    output_len: int = 128
    length_scale: float = 1.0
    arrival_rate: float = 0.0
    time_scale: float = 1.0
    temperature: float = 0.0
    ignore_eos: bool = True
    shared_prefix_len: int = 0
    # > 1 (with shared_prefix_len > 0): that many distinct prefixes, each request's drawn at random,
    # so requests sharing a prefix interleave in arrival order (longest-prefix-match studies)
    num_prefixes: int = 1
    # > 0: each request names one of client-0 .. client-{num_clients - 1} (per-client fair sharing),
    # drawn in proportion to client_weights (None: equal shares); 0: requests name no client
    num_clients: int = 0
    client_weights: list[float] | None = None
    # > 0: each request's priority is uniform in [0, num_priorities); 0: every request's is 0
    num_priorities: int = 0
    # vLLM's sampling keys, for every request (prompt files: each line's default, its own keys win).
    # A combination SamplingParams rejects fails at load, naming these keys.
    n: int = 1  # sequences returned per request (parallel sampling, or the beam width)
    best_of: int | None = None  # sequences sampled per request, the best n returned; None: n
    use_beam_search: bool = False  # beam width best_of (n by default, so n > 1); needs temperature 0
    length_penalty: float = 1.0  # beam search only: a beam scores logprob / length**length_penalty


@dataclass
class HardwareConfig:
    """The GPU that `executor=sim` simulates (conf/hardware/*.yaml documents each value's source).

    Per GPU: dense tensor-core fp16/bf16 and fp32 FLOP/s, HBM bandwidth and size (bytes), NVLink
    (per GPU, one direction) and PCIe bandwidth (B/s), SM count. Efficiencies are achieved / peak.
    `matmul_efficiency` is a table `[[tokens, efficiency], ...]`, interpolated in log(tokens).
    `calibrated: true` (cpu-local) fills the null values from a microbenchmark of this machine.
    """

    name: str = MISSING
    flops_fp16: float | None = None
    flops_fp32: float | None = None
    memory_bandwidth: float | None = None
    memory: str | None = None
    interconnect_bandwidth: float | None = None
    pcie_bandwidth: float | None = None
    num_sms: int = 1
    num_gpus: int = 1
    matmul_efficiency: list[Any] | None = None
    matmul_tile: int = 0
    memory_efficiency: float | None = None
    prefill_attention_efficiency: float | None = None
    decode_attention_efficiency: float | None = None
    kernel_launch_s: float | None = None
    allreduce_latency_s: float = 0.0
    pcie_latency_s: float = 0.0  # per host<->device copy: swap moves every block of every layer apart
    step_overhead_s: float | None = None
    seq_overhead_s: float | None = None
    calibrated: bool = False


@dataclass
class LoggerConfig:
    name: str = MISSING
    backend: str = "none"
    mode: str = "offline"
    project: str = "paged"
    entity: str | None = None
    tags: list[str] = field(default_factory=list)
    step_interval: int = 1  # log every n-th engine step (the summary and request table are always whole)


@dataclass
class ExecutorConfig:
    """Core keys; the YAML's other keys are settings of the `_target_` executor class."""

    name: str = MISSING
    _target_: str = MISSING


@dataclass
class ReportConfig:
    """What a sweep's report shows (paged/report); an experiment preset fills it in. Entries of
    `plots`, `paper`, `sustainable` and `ratio` are checked by the report, naming any unknown key."""

    title: str | None = None
    out: str | None = None  # a folder (relative to the launch folder) that also gets the report
    notes: str | None = None
    metrics: list[str] | None = None  # the table's columns; None: vLLM's benchmark metrics
    plots: list[Any] = field(default_factory=list)
    paper: list[Any] = field(default_factory=list)
    sustainable: Any = None
    ratio: Any = None


@dataclass
class Config:
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    seed: int = 0
    progress: bool = True
    # an index to sweep (`repeat=0,1,2`) for repeated measurements; the report folds it into median
    # and spread; it changes nothing in the run
    repeat: int = 0


# Nodes whose keys beyond the schema's are a plugin's own settings (checked against its class).
PLUGIN_NODES = ("allocator", "allocator.reservation", "scheduler.policy", "scheduler.preemption", "executor")


def register_configs() -> None:
    """The top-level schema types every group's node, so group YAMLs need no schema of their own
    (and no schema shows up as a selectable option). Plugin nodes stay open to extra keys; their
    schema keys are still typed."""
    schema = OmegaConf.structured(Config)
    for key in PLUGIN_NODES:
        OmegaConf.set_struct(OmegaConf.select(schema, key), False)
    ConfigStore.instance().store(name="base_schema", node=schema)


class ConfigError(ValueError):
    """A config value that its type allows but the framework does not."""


def _choice(key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")


def _positive(key: str, value: float | int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value!r} must be > 0")


def _check_blocksparse(values: Any, cache_block_size: int) -> None:
    try:
        sparse = BlockSparse.from_config(values)  # its errors name kernel.blocksparse and the allowed keys
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        sparse.check(cache_block_size)
    except ValueError as err:
        raise ConfigError(f"kernel.blocksparse: {err}; allocator.block_size={cache_block_size}") from err


def validate(cfg: Any, block_sizes: tuple[int, ...] = BLOCK_SIZES) -> None:
    """Range and choice checks on a composed config (a DictConfig or a `Config`); `block_sizes` are
    those the executor runs (the kernels' by default)."""
    a = cfg.allocator
    _choice("allocator.block_size", a.block_size, block_sizes)
    _positive("allocator.num_blocks", a.num_blocks, allow_none=True)
    if a.kv_cache_memory is not None:
        parse_bytes(a.kv_cache_memory)
        if a.num_blocks is not None:
            # the allocator YAMLs set num_blocks, which would otherwise silently win over the budget
            raise ConfigError(
                f"allocator.num_blocks={a.num_blocks} and allocator.kv_cache_memory={a.kv_cache_memory!r} both size "
                "the KV cache; set allocator.num_blocks=null to size it by memory, or drop kv_cache_memory"
            )
    if not 0.0 < a.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"allocator.gpu_memory_utilization={a.gpu_memory_utilization!r} must be in (0, 1]")
    if not 0.0 <= a.watermark < 1.0:
        raise ConfigError(f"allocator.watermark={a.watermark!r} must be in [0, 1)")
    parse_bytes(a.swap_space, key="allocator.swap_space")
    s = cfg.scheduler
    _choice("scheduler.preemption_mode", s.preemption_mode, ("recompute", "swap", "auto"))
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        _positive(f"scheduler.{key}", getattr(s, key))
    _choice("scheduler.batch_order", s.batch_order, ("decode-first", "prefill-first"))
    _positive("scheduler.max_num_partial_prefills", s.max_num_partial_prefills)
    if s.long_prefill_token_threshold < 0:
        raise ConfigError(
            f"scheduler.long_prefill_token_threshold={s.long_prefill_token_threshold!r} must be >= 0 "
            "(0: a chunk is capped by the token budget only)"
        )
    if s.max_num_batched_tokens < a.block_size:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens={s.max_num_batched_tokens} is below one KV block "
            f"(allocator.block_size={a.block_size}); a step must be able to fill a block"
        )
    if s.max_num_batched_tokens < s.max_model_len and not s.chunked_prefill:
        # without chunks a prompt (or a recomputed sequence) runs in one step: the budget must hold the longest
        raise ConfigError(
            f"scheduler.max_num_batched_tokens={s.max_num_batched_tokens} must be >= "
            f"scheduler.max_model_len={s.max_model_len} when scheduler.chunked_prefill=false "
            "(chunked prefill runs longer prompts in several steps)"
        )
    k = cfg.kernel
    _choice("kernel.version", k.version, ("auto", *VERSIONS))
    _choice("kernel.backend", k.backend, ("auto", *BACKENDS))
    _positive("kernel.partition_size", k.partition_size)
    if k.partition_size % a.block_size:
        raise ConfigError(
            f"kernel.partition_size={k.partition_size} must be a multiple of "
            f"allocator.block_size={a.block_size}"
        )
    _choice("kernel.kv_cache_dtype", k.kv_cache_dtype, ("auto", *KV_CACHE_DTYPES))
    for key in ("k_scale", "v_scale"):
        try:
            check_scale(f"kernel.{key}", getattr(k, key))
        except ValueError as err:
            raise ConfigError(f"{err} (null: calibrated from the first prefill)") from err
    if k.blocksparse is not None:
        _check_blocksparse(k.blocksparse, a.block_size)
    m = cfg.model
    _choice("model.source", m.source, ("gguf", "hf", "random", "spec"))
    _choice("model.dtype", m.dtype, DTYPE_NAMES)
    _choice("model.device", m.device, ("auto", "cpu", "cuda"))
    _choice("model.gemm", m.gemm, GEMMS)
    if m.source == "hf" and not m.path:
        raise ConfigError("model=hf needs model.path=/path/to/a/local/hf/checkpoint")
    if m.source == "spec" and not m.arch:
        raise ConfigError(f"model={m.name} has source=spec but no model.arch describing its shape")
    window = m.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ConfigError(
            f"model.sliding_window={window!r} must be a positive number of tokens, or null for the checkpoint's own"
        )
    _positive("hardware.num_gpus", cfg.hardware.num_gpus)
    w = cfg.workload
    _choice("workload.kind", w.kind, ("synthetic", "fixed", "prompts", "trace"))
    if w.num_requests is None and w.kind != "trace":
        raise ConfigError(
            "workload.num_requests=null (the whole trace) is only allowed for workload=trace; "
            f"workload={w.kind} needs a count > 0"
        )
    _positive("workload.num_requests", w.num_requests, allow_none=True)
    if w.kind in ("prompts", "trace") and not w.path:
        raise ConfigError(f"workload={w.kind} needs workload.path=FILE")
    if w.arrival_rate < 0:
        raise ConfigError(
            f"workload.arrival_rate={w.arrival_rate!r} must be >= 0 (requests/s; 0 submits all at once)"
        )
    if w.kind == "fixed":
        _positive("workload.prompt_len", w.prompt_len)
        _positive("workload.output_len", w.output_len)
        if not 0 <= w.shared_prefix_len <= w.prompt_len:
            raise ConfigError(
                f"workload.shared_prefix_len={w.shared_prefix_len!r} must be in [0, workload.prompt_len="
                f"{w.prompt_len}] for workload=fixed"
            )
    if w.num_prefixes < 1:
        raise ConfigError(f"workload.num_prefixes={w.num_prefixes!r} must be >= 1 (1: one prefix shared by all)")
    if w.num_prefixes > 1 and w.shared_prefix_len <= 0:
        raise ConfigError(
            f"workload.num_prefixes={w.num_prefixes} needs workload.shared_prefix_len > 0, got "
            f"{w.shared_prefix_len}: there is no prefix to vary"
        )
    if w.num_clients < 0:
        raise ConfigError(f"workload.num_clients={w.num_clients!r} must be >= 0 (0: requests name no client)")
    if w.client_weights is not None:
        weights = list(w.client_weights)
        if w.num_clients == 0:
            raise ConfigError(
                f"workload.client_weights={weights} needs workload.num_clients > 0 (one weight per client)"
            )
        if len(weights) != w.num_clients:
            raise ConfigError(
                f"workload.client_weights={weights} must have one weight per client: "
                f"{w.num_clients} (workload.num_clients), got {len(weights)}"
            )
        if min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(
                f"workload.client_weights={weights} must all be >= 0 with a sum > 0 (relative request shares)"
            )
    if w.num_priorities < 0:
        raise ConfigError(
            f"workload.num_priorities={w.num_priorities!r} must be >= 0 (0: every request's priority is 0)"
        )
    _choice("logger.backend", cfg.logger.backend, ("wandb", "none"))
    _choice("logger.mode", cfg.logger.mode, ("offline", "disabled", "online"))


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str | int, key: str = "allocator.kv_cache_memory") -> int:
    """'256MiB' / '1GB' / '1048576' -> bytes; `key` names the setting in the error."""
    s = str(text).strip().upper().replace(" ", "")
    digits = s.rstrip("ABEGIKM")
    unit = s[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ConfigError(
            f"{key}={text!r} is not a positive size; use e.g. 512MiB, 1GiB, 1048576"
        )
    return int(value * _UNITS[unit])
