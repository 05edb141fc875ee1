"""The run's configuration: typed dataclasses (`schema`), loaded from YAML with dotted overrides
(`load`), checked across fields (`checks`), described for `--help-config` (`describe`), with the
named model sizes (`presets`). Unknown keys and wrong types are errors that name the key."""

from raylm.config.checks import global_batch_sequences, validate
from raylm.config.load import (build_dataclass, config_changes, config_from_dict, config_to_dict, config_to_yaml,
                               flat_keys, load_config, merge_trees, parse_overrides, saved_config)
from raylm.config.schema import (CONFIG_FILE, ActivationCheckpointing, BatchRampup, CheckpointConfig, Config,
                                 DataConfig, GuardConfig, LRScheduleName, MixtureComponent, ModelConfig, OptimConfig,
                                 ParallelConfig, PipelineScheduleName, ProfileConfig, RunConfig, ScheduleConfig,
                                 Sharding, StorageConfig, TaskEvalConfig, TrainConfig)
from raylm.errors import ConfigError

__all__ = ["CONFIG_FILE", "ActivationCheckpointing", "BatchRampup", "CheckpointConfig", "Config", "ConfigError",
           "DataConfig", "GuardConfig", "LRScheduleName", "MixtureComponent", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PipelineScheduleName", "ProfileConfig", "RunConfig", "ScheduleConfig", "Sharding", "StorageConfig",
           "TaskEvalConfig", "TrainConfig", "build_dataclass", "config_changes", "config_from_dict", "config_to_dict", "config_to_yaml",
           "flat_keys", "global_batch_sequences", "load_config", "merge_trees", "parse_overrides", "saved_config",
           "validate"]
