"""shardemu: run large-model training recipes for real on virtual JAX devices.

The public API. Typical use, before anything touches a JAX device:

    import shardemu
    shardemu.use_virtual_devices(8)
    mesh = shardemu.make_mesh(tensor=2, replica=4)       # a plain jax.sharding.Mesh
    model = shardemu.Model(shardemu.get_preset("gpt-tiny"))
    trainer = shardemu.Trainer(model, mesh, shardemu.TrainConfig())

and planning from shapes alone, with nothing allocated:

    planned = shardemu.plan(shardemu.get_preset("gpt3-1.3b"), shardemu.Parallelism(pipe=2),
                            shardemu.TrainConfig(batch=8, seq=1024),
                            shardemu.get_hardware("a100-80gb"))
    planned.step_time_s, planned.ledger, planned.timeline

and any jitted function of your own, counted on a mesh and timed on a profile:

    ledger = shardemu.count(step, params, batch, mesh=mesh, rules=shardemu.megatron_rules())
    timeline, prediction = shardemu.predict_ledger(
        ledger, shardemu.get_hardware("h100-sxm"), precision="bf16", mesh=mesh)
"""

from importlib import metadata

try:
    __version__ = metadata.version("shardemu")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

from shardemu.accounting.function import count
from shardemu.accounting.ledger import Ledger
from shardemu.config import ModelConfig, Parallelism, PhasedConfig, SparsityConfig, TrainConfig
from shardemu.data import StdlibCorpus, SyntheticCorpus
from shardemu.devices import use_virtual_devices
from shardemu.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    DeviceError,
    HardwareError,
    NonFiniteError,
    RunDirError,
    RunInterrupted,
    ShardemuError,
    ShardingError,
)
from shardemu.models import PRESETS, Family, Model, get_preset, param_bytes, param_count
from shardemu.models.layers import layer_stack
from shardemu.models.logical import logical_params
from shardemu.numerics.optim import make_optimizer
from shardemu.parallel.mesh import AXIS_NAMES, PIPE, REPLICA, TENSOR, make_mesh
from shardemu.parallel.rules import (
    activation_rules,
    constrain,
    logical_to_spec,
    megatron_rules,
    named_shardings,
    param_table,
    resolve_specs,
)
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.predict.counted import predict_ledger
from shardemu.predict.hardware import Hardware
from shardemu.predict.layouts import Space
from shardemu.predict.overlap import Overlap
from shardemu.predict.plan import Plan
from shardemu.predict.planning import plan
from shardemu.predict.prediction import Prediction
from shardemu.predict.profiles import PROFILES, get_hardware
from shardemu.predict.rows import SearchResult, SearchRow
from shardemu.predict.search import search
from shardemu.report.describe import describe
from shardemu.report.trackers import Tracker, Trackers, TrackingConfig
from shardemu.resident.trainer import Trainer
from shardemu.run.engine import (
    Engine,
    PhasedEngine,
    PipelinedEngine,
    ResidentEngine,
    StepResult,
)
from shardemu.run.loop import StepInfo, TrainLoop
from shardemu.run.record import RunSettings, resume_settings
from shardemu.run.runner import RunResult, train
from shardemu.sparsity import SparseState, wrap_optax

__all__ = [
    "PROFILES",
    "Hardware",
    "Overlap",
    "PhasedConfig",
    "PhasedTrainer",
    "Plan",
    "SearchResult",
    "SearchRow",
    "Space",
    "get_hardware",
    "plan",
    "search",
    "Ledger",
    "Prediction",
    "count",
    "predict_ledger",
    "AXIS_NAMES",
    "PIPE",
    "PRESETS",
    "REPLICA",
    "TENSOR",
    "ConfigError",
    "DeviceError",
    "Family",
    "Model",
    "ModelConfig",
    "NonFiniteError",
    "Parallelism",
    "RunInterrupted",
    "RunResult",
    "RunSettings",
    "SparseState",
    "SparsityConfig",
    "Tracker",
    "Trackers",
    "TrackingConfig",
    "ShardingError",
    "StepResult",
    "StepInfo",
    "TrainLoop",
    "Engine",
    "ResidentEngine",
    "PhasedEngine",
    "ShardemuError",
    "CapacityError",
    "CheckpointError",
    "HardwareError",
    "RunDirError",
    "StdlibCorpus",
    "SyntheticCorpus",
    "TrainConfig",
    "PipelinedEngine",
    "PipelinedTrainer",
    "Trainer",
    "activation_rules",
    "constrain",
    "describe",
    "get_preset",
    "logical_to_spec",
    "layer_stack",
    "logical_params",
    "make_mesh",
    "make_optimizer",
    "megatron_rules",
    "named_shardings",
    "param_bytes",
    "param_count",
    "param_table",
    "resolve_specs",
    "resume_settings",
    "train",
    "use_virtual_devices",
    "wrap_optax",
    "__version__",
]
