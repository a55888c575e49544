"""Configuration dataclasses, validated on construction.

Everything a run depends on is one of these frozen dataclasses, so a run directory can
record it whole (`dataclasses.asdict`) and two runs can be compared field by field:
`ModelConfig` (model.py), `Parallelism` (parallelism.py), `TrainConfig` and
`SparsityConfig` (train.py), `PhasedConfig` (phased.py); the checks they share in
checks.py; each setting's command-line flag, declared on its field, in flags.py.

Model presets live with their families (`models/gpt.py`, `models/bert.py`), each
with its sources; `ModelConfig.family` names a registered family (`models/family.py`).
"""

from shardemu.config.checks import MAX_TOKENS_PER_STEP, SEED_LIMIT, require_positive
from shardemu.config.flags import Flag, Setting, setting, settings_of
from shardemu.config.model import MASKED_LM_PROB, ModelConfig
from shardemu.config.parallelism import Parallelism
from shardemu.config.phased import PhasedConfig
from shardemu.config.train import (
    BLOCK_SIZES,
    DATASETS,
    PRECISIONS,
    SCHEDULES,
    OptimizerName,
    SparsityConfig,
    TrainConfig,
)
from shardemu.errors import ConfigError

__all__ = [
    "BLOCK_SIZES",
    "DATASETS",
    "MASKED_LM_PROB",
    "MAX_TOKENS_PER_STEP",
    "PRECISIONS",
    "SCHEDULES",
    "SEED_LIMIT",
    "ConfigError",
    "Flag",
    "ModelConfig",
    "OptimizerName",
    "Parallelism",
    "PhasedConfig",
    "Setting",
    "SparsityConfig",
    "TrainConfig",
    "require_positive",
    "setting",
    "settings_of",
]
