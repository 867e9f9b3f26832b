"""Config: typed schemas (`schema`), the values keys allow (`choices`), range checks (`validate`),
composing a config from overrides (`compose`), and what `model.dtype` means on a device (`dtype`).
Imports nothing of the model or the kernels."""

from paged.config.compose import CONF_DIR, check_command_line, compose_config, config_groups
from paged.config.dtype import dtype_note, resolve_dtype
from paged.config.keys import check_keys, check_overrides, did_you_mean
from paged.config.schema import (
    PLUGIN_NODES,
    AllocatorConfig,
    ClusterConfig,
    Config,
    ConfigError,
    ExecutorConfig,
    HardwareConfig,
    KernelConfig,
    LoggerConfig,
    ModelConfig,
    OptionalPluginConfig,
    PluginConfig,
    ReportConfig,
    RouterConfig,
    SchedulerConfig,
    ServerConfig,
    WorkloadConfig,
    register_configs,
)
from paged.config.units import parse_bytes
from paged.config.validate import ByteSizes, validate

__all__ = [
    "CONF_DIR", "PLUGIN_NODES", "AllocatorConfig", "ByteSizes", "ClusterConfig", "Config", "ConfigError",
    "ExecutorConfig", "HardwareConfig", "KernelConfig", "LoggerConfig", "ModelConfig", "OptionalPluginConfig",
    "PluginConfig", "ReportConfig", "RouterConfig", "SchedulerConfig", "ServerConfig", "WorkloadConfig",
    "check_command_line", "check_keys", "check_overrides", "compose_config", "config_groups", "did_you_mean",
    "dtype_note", "parse_bytes", "register_configs", "resolve_dtype", "validate",
]
