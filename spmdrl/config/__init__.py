"""The run's configuration: typed sections (``sections``; the rollout's in ``rollout``), parsing the command
line (``parse``), the checks that run before any work (``checks``) and the cheap model-folder and data-file
checks they use (``model_folder``, ``inputs``).

    from spmdrl.config import Config
    cfg, debug = parse_config(argv)          # spmdrl.config.parse
    validate_config(cfg, world_size)         # spmdrl.config.checks: ConfigError on bad input
"""

from spmdrl.config.rollout import MultiTurnConfig, RolloutConfig, ValKwargsConfig
from spmdrl.config.sections import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    ModelConfig,
    OverlongBufferConfig,
    ParallelConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    TrainerConfig,
    dump_config,
    output_dir,
)

__all__ = [
    "ActorConfig", "AlgorithmConfig", "Config", "CriticConfig", "DataConfig", "FilterGroupsConfig",
    "KLCtrlConfig", "ModelConfig", "MultiTurnConfig", "OverlongBufferConfig", "ParallelConfig", "RefConfig",
    "RewardConfig",
    "RewardModelConfig", "RewardModelModelConfig", "RolloutConfig", "TrainerConfig", "ValKwargsConfig",
    "dump_config", "output_dir",
]
