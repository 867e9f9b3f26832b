"""Typed config schemas. Registered in Hydra's ConfigStore so a mistyped key or a wrong type fails
before any model loads; `paged.config.validate` adds the range checks a type cannot express."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from paged.config.choices import DEFAULT_PARTITION_SIZE


class ConfigError(ValueError):
    """A config value that its type allows but the framework does not."""


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
class OffloadConfig:
    """Tiers for evicted prefix blocks (paged.memory.kv_tiers): a cached block the device evicts is
    copied to `cpu_bytes` of host memory (0: off), and what that tier evicts to files of at most
    `disk_bytes` under `disk_path` (null: no disk tier); a later prefix hit there comes back by copy
    instead of being recomputed. Each tier evicts by its own policy (a conf/allocator/eviction name)."""

    cpu_bytes: str = "0"
    disk_path: str | None = None
    disk_bytes: str | None = None
    cpu_eviction: str = "lru"
    disk_eviction: str = "lru"


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
    # KV groups per layer type (paged.kv_layout): auto gives each attention type (window) its own block
    # tables from the shared pool, so a sliding-window group frees what leaves its window while a full
    # one keeps its blocks; single is one table for every layer (the layout before KV groups)
    kv_groups: str = "auto"
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    reservation: PluginConfig = _plugin("paged.memory.reservation.ExactReservation")
    # which unreferenced cached block a full pool evicts (conf/allocator/eviction); only a prefix cache has any
    eviction: PluginConfig = _plugin("paged.memory.eviction.lru.LRUPolicy")


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
    # Schedule and launch step N+1 while the device runs step N; the sampled tokens stay on the device
    # and the host applies them (stops, outputs) a step later (paged/engine/async_step.py). null: on for
    # a CUDA model executor that can run it, off elsewhere; true where it cannot run is a config error.
    async_scheduling: bool | None = None
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
    # float32 / float16 / bfloat16, or auto: bfloat16 where the model runs on CUDA, else float32
    dtype: str = "float32"
    device: str = "auto"
    chat_template: bool = False
    arch: dict[str, Any] = field(default_factory=dict)
    # Attention window in tokens (Mistral-style); None: the checkpoint's own (none for most models)
    sliding_window: int | None = None
    # The linear layers' kernel (paged.model.linear): auto, torch (F.linear), onednn (prepacked) or packed
    # (paged's AVX-512 loop, oneDNN for the layers it cannot tile)
    gemm: str = "auto"
    # a CPU decode step's layers in one native call where every call of the step is one it makes
    # (paged.model.decode_layers); false: the Python forward always (the same results, to the bit)
    native_decode: bool = True
    # source=gguf: reuse the dequantized weights cached on disk (keyed by the file's SHA-256); false: dequantize
    weight_cache: bool = True
    # CPU threads for torch and the native kernels; None: the cores this process may use (paged.utils.threads)
    num_threads: int | None = None


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
    prompt_len: int = 512  # kind fixed: every request's exact lengths (their sum must fit scheduler.max_model_len)
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
    # how requests (multiturn, agent: sessions) pick among num_prefixes: uniform, or zipf (prefix k with
    # weight 1/(k+1)^prefix_zipf_s, s > 0): a few hot prefixes and a cold tail (eviction studies)
    prefix_popularity: str = "uniform"
    prefix_zipf_s: float = 1.0
    # multiturn, agent (closed-loop: a turn is sent once the previous one's reply exists): num_sessions
    # sessions arriving at arrival_rate/s, each of turns_per_session turns (fewer when the conversation
    # would outgrow scheduler.max_model_len), the next turn sent an exponential think time (mean
    # think_time_s) after the reply; num_requests, when set, caps the turns over all sessions
    num_sessions: int = 8
    turns_per_session: int = 4
    think_time_s: float = 1.0
    # > 0: each request names one of client-0 .. client-{num_clients - 1} (per-client fair sharing),
    # drawn in proportion to client_weights (None: equal shares); 0: requests name no client
    num_clients: int = 0
    client_weights: list[float] | None = None
    # true: clients are tenants with their own system prompt, client k's prefix is k mod num_prefixes
    # (else each request's prefix is drawn at random, whatever its client)
    tenant_prefixes: bool = False
    # > 0: each request's priority is uniform in [0, num_priorities); 0: every request's is 0
    num_priorities: int = 0
    # vLLM's sampling keys, for every request (prompt files: each line's default, its own keys win).
    # A combination SamplingParams rejects fails before the model loads (paged.engine.builder.check_config),
    # naming these keys.
    n: int = 1  # sequences returned per request (parallel sampling, or the beam width)
    best_of: int | None = None  # sequences sampled per request, the best n returned; None: n
    use_beam_search: bool = False  # beam width best_of (n by default, so n > 1); needs temperature 0
    length_penalty: float = 1.0  # beam search only: a beam scores logprob / length**length_penalty


@dataclass
class KVPressConfig:
    """KV compression (paged.memory.press): `_target_` null is no press (`kv_press=none`). The budget is
    `ratio` (keep 1/ratio of a sequence's tokens) or `max_tokens`; the last `window` tokens are always
    kept; `interval` N > 0 judges a sequence again every N decode steps (0: only after its prompt). The
    YAML's other keys are settings of the press class (sink-window's `sink`)."""

    name: str = "none"
    _target_: str | None = None
    ratio: float | None = None
    max_tokens: int | None = None
    window: int = 0
    interval: int = 0


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
    # B/s of the host's disk, read and write (a prefix tier's files, `allocator.offload.disk_path`)
    disk_bandwidth: float | None = None
    # Where GPUs sit, for disaggregated prefill/decode's KV transfers (paged.cluster.kv_link): GPUs per
    # node (NVLink between them: interconnect_bandwidth), the latency of one copy over NVLink, and the
    # network across nodes: B/s per GPU one way (its NIC) and one copy's latency. Null: not given.
    gpus_per_node: int | None = None
    interconnect_latency_s: float | None = None
    network_bandwidth: float | None = None
    network_latency_s: float | None = None
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
    # advance the simulated clock over decode iterations in which nothing can change in one move,
    # byte-identical to stepping them (paged/engine/fast_forward.py); executor=sim only (its YAML
    # turns it on); false steps one iteration at a time
    fast_forward: bool = False


@dataclass
class RouterConfig:
    """Core keys; the YAML's other keys are settings of the `_target_` router class (paged/cluster)."""

    name: str = MISSING
    _target_: str = MISSING


@dataclass
class ClusterConfig:
    """Replicas of the whole engine behind a router (paged/cluster). One replica is a plain engine."""

    num_replicas: int = 1
    # where replicas run: `local` (in this process: executor=sim's fleet on one virtual clock, or real
    # engines stepped in turn), `ray` (one Ray actor per replica), `auto` (ray for a real model when
    # there is more than one replica, local otherwise)
    backend: str = "auto"
    address: str | None = None  # an existing Ray cluster (`ray://host:10001` or `auto`); None: a local Ray
    num_cpus_per_replica: float = 1.0  # the Ray resources one replica actor reserves
    # disaggregated prefill/decode (executor=sim): both > 0 replace num_replicas with two pools
    prefill_replicas: int = 0
    decode_replicas: int = 0


@dataclass
class SLOConfig:
    """Service-level objectives the summary's `goodput` counts against (paged.engine.slo); null: none."""

    ttft_s: float | None = None
    tpot_s: float | None = None


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
    # true: a preset's sweep also replaces experiments/results/NAME/ (the committed results); false: its run dir only
    publish: bool = False


@dataclass
class ServerConfig:
    """`python -m paged.serve` (docs/serving.md): where it listens and the model name it answers to.
    Another address than 127.0.0.1 only when asked: the server has no authentication."""

    name: str = MISSING
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port, printed when the server starts
    served_model_name: str | None = None  # the `model` clients send; None: model.name


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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    kv_press: KVPressConfig = field(default_factory=KVPressConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    seed: int = 0
    progress: bool = True
    # an index to sweep (`repeat=0,1,2`) for repeated measurements; the report folds it into median
    # and spread; it changes nothing in the run
    repeat: int = 0


# Nodes whose keys beyond the schema's are a plugin's own settings (checked against its class).
PLUGIN_NODES = (
    "allocator", "allocator.reservation", "allocator.eviction", "scheduler.policy", "scheduler.preemption", "executor",
    "router", "kv_press",
)


@functools.cache
def _base_schema() -> DictConfig:
    """The registered schema node, built once a process: OmegaConf.structured(Config) takes ~0.1 s and
    every compose_config registers it; ConfigStore stores a copy, so this one is never changed."""
    schema = OmegaConf.structured(Config)
    for key in PLUGIN_NODES:
        OmegaConf.set_struct(OmegaConf.select(schema, key), False)
    return schema


def register_configs() -> None:
    """The top-level schema types every group's node, so group YAMLs need no schema of their own
    (and no schema shows up as a selectable option). Plugin nodes stay open to extra keys; their
    schema keys are still typed."""
    ConfigStore.instance().store(name="base_schema", node=_base_schema())
