"""What a model looks like on a mesh, computed from shapes alone (nothing allocated).

`describe` works for any preset at any mesh size because it needs only the mesh's axis
sizes, not its devices: GPT-3 175B on 256 devices is described in about a second.
"""

from __future__ import annotations

from typing import Any

from shardemu.config import ModelConfig, Parallelism
from shardemu.models import Model, as_model, param_bytes, param_count
from shardemu.parallel.rules import Rules, param_table, resolve_specs, rules_or_default


def describe(
    model: Model | ModelConfig, par: Parallelism, rules: Rules | None = None
) -> dict[str, Any]:
    """Every parameter's path, shape, logical axes, PartitionSpec and bytes per device,
    with totals, of `model` (a `Model` or a registered family's config); the JSON that
    `shardemu describe --json` prints."""
    model = as_model(model)
    model.check_rules(rules)
    rules = rules_or_default(
        rules, False, par.expert, par.context, tensor=par.tensor, kv_heads=model.cfg.kv_heads
    )
    shapes, logical = model.abstract_params()
    axis_sizes = par.axis_sizes()
    specs = resolve_specs(shapes, logical, rules, axis_sizes)
    rows = param_table(shapes, logical, specs, axis_sizes)
    return {
        "model": model.name,
        "mesh": str(par),
        "devices": par.num_devices,
        "param_count": param_count(shapes),
        "param_bytes": param_bytes(shapes),
        "bytes_per_device": sum(r.bytes_per_device for r in rows),
        "rules": [[name, axes] for name, axes in rules],
        "params": [r.to_json() for r in rows],
    }
