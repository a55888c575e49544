"""Settings from a file: `--config FILE.toml` (every flag is a key) or a run
directory's `config.json` (`shardemu run --config runs/x/config.json` re-runs it).

A key is a flag's name without the dashes (`grad-accum`) or its Python name
(`grad_accum`); flags given on the command line win over the file. The same
`apply_settings` sets a sweep's trial parameters (`sweep.py`), so a file, a sweep and
the command line are typed and checked alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from shardemu.cli.fields import int_list, to_flags
from shardemu.cli.settings import model_config
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.config.files import read_text
from shardemu.models import PRESETS
from shardemu.parallel.rules import rules_or_default

# keys that make no sense inside a settings file
_NOT_SETTINGS = ("help", "config", "resume", "version")
_KINDS = {int: "an integer", float: "a number", str: "a string"}


def read_settings(path: str | Path, command: argparse.ArgumentParser) -> dict[str, Any]:
    """The settings in `path` for `command`: a TOML file of its flags, or a run
    directory's config.json turned back into the flags that make the same run, and
    those into `command`'s (`for_command`)."""
    path = Path(path)
    text = read_text(path, "--config", ConfigError)
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ConfigError(f"--config {path} holds a {type(data).__name__}, not settings")
            if "train" in data and "model" in data:
                return for_command(run_flags(data, path), command, path)
            return data
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        kind = path.suffix[1:].upper()
        raise ConfigError(f"--config {path} is not valid {kind}: {err}") from None
    raise ConfigError(f"--config {path}: give a .toml file of flags or a run's config.json")


def for_command(
    flags: dict[str, Any], command: argparse.ArgumentParser, path: Path
) -> dict[str, Any]:
    """A run's flags (`run_flags`) as `command`'s. `run` takes them all; `plan`,
    `search` and `describe` take those they have and leave out the rest, named in one
    notice (one step's count depends on neither a run's length, nor its learning rate,
    nor its data; a search lays the model out itself). A plan takes the run's
    microbatches as `--microbatch-size`, the run's per replica. What a plan or a search
    would count otherwise is refused: an optimizer other than AdamW (they count AdamW's
    update), and for a plan a pipeline that accumulates several passes (it runs one)."""
    name = command.prog.split()[-1]
    if name == "run":
        return flags
    keys = _keys(command)
    kept = {k: v for k, v in flags.items() if k in keys}
    left = {k: v for k, v in flags.items() if k not in keys}
    mapped = ""
    if name in ("plan", "search") and left.get("optimizer", "adamw") != "adamw":
        raise ConfigError(
            f"--config {path}: the run trained with {left['optimizer']}, and `shardemu "
            f"{name}` counts AdamW's update only; give the run's settings as flags to "
            f"{name} it with AdamW's"
        )
    if name == "plan":
        micro, accum = left.pop("microbatches", 1), left.pop("grad_accum", 1)
        par = Parallelism.parse(flags["mesh"])
        if par.pipe > 1 and accum > 1:
            raise ConfigError(
                f"--config {path}: the run accumulates {accum} pipelined passes of {micro} "
                f"microbatches, and a plan runs one pass; plan it with --microbatch-size "
                f"and without --config"
            )
        per_replica = flags["batch"] // (par.replica * par.expert * micro * accum)
        kept.setdefault("microbatch_size", per_replica)
        mapped = f"; microbatches={micro}, grad_accum={accum} as --microbatch-size {per_replica}"
    if left:
        logging.getLogger("shardemu").warning(
            f"--config {path}: a run's settings that `shardemu {name}` has no flag for, "
            f"left out: {', '.join(f'{k}={v}' for k, v in left.items())}{mapped}"
        )
    return kept


def apply_settings(
    command: argparse.ArgumentParser,
    args: argparse.Namespace,
    settings: dict[str, Any],
    source: str,
) -> None:
    """Set `settings` on `args` for the flags the command line did not give
    (`args.given`), typed and checked as argparse would; an unknown key, a value of the
    wrong type or outside its choices is an error naming the key and `source`."""
    keys = _keys(command)
    for key, value in settings.items():
        action = keys.get(key)
        if key.replace("-", "_") in _NOT_SETTINGS:
            raise ConfigError(
                f"{key} in {source} is not a setting; give --{key.replace('_', '-')} on the "
                f"command line"
            )
        if action is None:
            near = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"unknown key {key!r} in {source}{hint} (the keys are the flags of "
                f"`shardemu {command.prog.split()[-1]}`, without the dashes)"
            )
        if action.dest in args.given:
            continue
        setattr(args, action.dest, _typed(action, key, value, source))


def _keys(command: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every name a setting may have: the flag without dashes (`grad-accum`, or
    `grad_accum`), and its destination, the config field (`learning_rate` for `lr`)."""
    keys: dict[str, argparse.Action] = {}
    for action in command._actions:
        if action.dest in _NOT_SETTINGS or not action.option_strings:
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                keys[option[2:]] = action
                keys.setdefault(option[2:].replace("-", "_"), action)
        keys.setdefault(action.dest, action)
    return keys


def _typed(action: argparse.Action, key: str, value: Any, source: str) -> Any:
    """`value` as the flag's destination holds it."""
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigError(f"{key} in {source} is a switch: give true or false, not {value!r}")
        named = key != action.dest  # `no-prefetch = true` means prefetch = False
        return (action.const if value else action.default) if named else value
    if action.nargs == "?" and isinstance(value, bool):  # `wandb = true`: the default project
        return action.const if value else None
    if action.type is int_list:  # a tuple field: `3,7,7,7` or [3, 7, 7, 7]
        if isinstance(value, list) and all(type(n) is int for n in value):
            return tuple(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} in {source}: {flag} takes a list of integers")
        try:
            return int_list(value)
        except argparse.ArgumentTypeError as err:
            raise ConfigError(f"{key} = {value!r} in {source}: {flag} {err}") from None
    kind = action.type or str
    ok = (
        (kind is int and isinstance(value, int) and not isinstance(value, bool))
        or (kind is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (kind is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{key} = {value!r} in {source}: {flag} takes {_KINDS[kind]}")
    value = kind(value)
    if action.choices is not None and value not in action.choices:
        raise ConfigError(
            f"{key} = {value!r} in {source}: {flag} is one of {', '.join(map(str, action.choices))}"
        )
    return value


def run_flags(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The flags of `shardemu run` that make the run a config.json records. Settings
    no flag can express (a model or rules set from Python) are refused, named."""
    try:
        model = ModelConfig(**cfg["model"])
        par = Parallelism(**cfg["parallelism"])
        train = TrainConfig(**cfg["train"])
        phased = PhasedConfig(**cfg["phased"]) if cfg.get("phased") else None
    except (KeyError, TypeError) as err:
        raise ConfigError(f"--config {path} is not a run's config.json ({err})") from None
    flags: dict[str, Any] = {**_model_flags(model, train.seq, path), "mesh": _mesh(par)}
    if cfg.get("device_count", par.num_devices) != par.num_devices:
        flags["devices"] = cfg["device_count"]
    flags |= to_flags(train)
    default = [
        [n, list(a) if isinstance(a, tuple) else a]
        for n, a in rules_or_default(
            None,
            train.sequence_parallel,
            par.expert,
            par.context,
            tensor=par.tensor,
            kv_heads=model.kv_heads,
        )
    ]
    # runs recorded before a logical name existed (residual_sequence, kv_heads, experts)
    # lack its rule: the default less those names
    recorded = cfg.get("rules")
    names = {rule[0] for rule in recorded or ()}
    if recorded is not None and recorded != [rule for rule in default if rule[0] in names]:
        raise ConfigError(
            f"--config {path}: its sharding rules are not the default, and no flag sets "
            f"them; re-run it from Python with shardemu.train"
        )
    if train.sparsity is not None:
        flags |= {"sparsity": train.sparsity.sparsity, **to_flags(train.sparsity)}
    if phased is not None:
        flags |= {"phased": True, **to_flags(phased)}
    for key in ("checkpoint_every", "eval_every"):
        if cfg.get(key) is not None:
            flags[key] = cfg[key]
    flags |= {k: v for k, v in (cfg.get("tracking") or {}).items() if v}
    if cfg.get("hardware"):
        flags["hardware"] = cfg["hardware"]
    return flags


def _mesh(par: Parallelism) -> str:
    return str(par)


def _model_flags(model: ModelConfig, seq: int, path: Path) -> dict[str, Any]:
    """--model (a preset, with --pad-vocab when padded) or --model FAMILY with its
    dimensions, and BERT's --max-predictions when set; checked by building the model
    back as the command line would."""
    preset = PRESETS.get(model.name)
    if preset is not None:
        flags: dict[str, Any] = {"model": model.name}
        if model.vocab_size != preset.vocab_size:
            flags["pad_vocab"] = model.vocab_size
    else:
        flags = {
            "model": model.family,
            "layers": model.num_layers,
            "hidden": model.embed_dim,
            "heads": model.num_heads,
            "mlp": model.mlp_dim,
            "vocab": model.vocab_size,
        }
        if model.num_kv_heads:
            flags["kv_heads"] = model.num_kv_heads
    if model.max_predictions:
        flags["max_predictions"] = model.max_predictions
    names = (
        "model", "layers", "hidden", "heads", "kv_heads", "mlp", "vocab", "pad_vocab",
        "max_predictions",
    )  # fmt: skip
    rebuilt = model_config(argparse.Namespace(**{n: flags.get(n) for n in names}, seq=seq))
    if rebuilt != model:
        differ = [
            f.name
            for f in dataclasses.fields(model)
            if getattr(model, f.name) != getattr(rebuilt, f.name)
        ]
        raise ConfigError(
            f"--config {path}: the model {model.name} differs from what flags build "
            f"({', '.join(differ)}); re-run it from Python with shardemu.train"
        )
    return flags
