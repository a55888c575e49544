"""Sweeps in the W&B Sweeps style: a TOML file with W&B's sweep configuration keys
(`method`, `metric` {name, goal}, `parameters` {NAME: {value | values | distribution,
min, max, q}}, `run_cap`; W&B docs, "Define a sweep configuration"), plus `command`
(`run` or `plan`) for what each trial is.

Each trial is a run directory `SWEEP_DIR/trial-NNN/`. A trial that finished has a
`trial.json` beside its run's files; re-running the sweep skips those and reruns the
others from scratch, so an interrupted sweep resumes. `sweep.json` and `summary.md`
hold every trial, best first, and are rewritten after each trial.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardemu.config.files import read_text
from shardemu.errors import ConfigError, RunDirError, RunInterrupted, ShardemuError
from shardemu.report.rundir import fmt_value, read_metrics
from shardemu.report.scalars import scalars

MAX_TRIALS = 10_000  # trials of one sweep: each a run directory, all listed up front
_TOP_KEYS = ("command", "method", "metric", "parameters", "run_cap", "name", "description")
_DISTRIBUTIONS = (
    "constant",
    "categorical",
    "int_uniform",
    "uniform",
    "log_uniform_values",
    "q_uniform",
)
# flags a trial cannot take, and why
_NOT_PARAMETERS = {
    "out": "the sweep sets each trial's --out",
    "processes": "trials run in the sweep's process, one after another",
    "resume": "a sweep resumes by itself: run the same sweep command again",
    "config": "give the settings as parameters",
}
TRIAL_FILE = "trial.json"
RANDOM_SEED = 0  # random trials are drawn from a fixed seed, so a resumed sweep draws the same


@dataclass(frozen=True)
class Sweep:
    command: str
    method: str
    metric: str
    goal: str
    parameters: dict[str, dict[str, Any]]
    run_cap: int | None
    source: str

    def trials(self) -> list[dict[str, Any]]:
        """Every trial's parameters: the grid's product in parameter order, or
        `run_cap` random draws."""
        if self.method == "grid":
            names = list(self.parameters)
            choices = [_choices(self.parameters[n]) for n in names]
            combos = itertools.islice(itertools.product(*choices), self.run_cap)
            return [dict(zip(names, combo, strict=True)) for combo in combos]
        rng = np.random.default_rng(RANDOM_SEED)
        return [
            {name: _draw(spec, rng) for name, spec in self.parameters.items()}
            for _ in range(self.run_cap or 0)
        ]

    def varied(self) -> list[str]:
        """The parameters that take more than one value."""
        return [n for n, spec in self.parameters.items() if "value" not in spec]


def load_sweep(path: str | Path) -> Sweep:
    """The sweep in `path`, every key checked: the first mistake is named."""
    path = Path(path)
    try:
        cfg = tomllib.loads(read_text(path, "sweep file", ConfigError))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"sweep file {path} is not valid TOML: {err}") from None
    unknown = [k for k in cfg if k not in _TOP_KEYS]
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r} in {path}; a sweep has {', '.join(_TOP_KEYS)}"
        )
    command, method = cfg.get("command", "run"), cfg.get("method", "grid")
    if command not in ("run", "plan"):
        raise ConfigError(f"command = {command!r} in {path}: a trial is a `run` or a `plan`")
    if method not in ("grid", "random"):
        raise ConfigError(
            f"method = {method!r} in {path}: grid and random are supported (W&B's bayes "
            f"needs its server)"
        )
    metric = cfg.get("metric", {})
    goal = metric.get("goal", "minimize") if isinstance(metric, dict) else None
    if not isinstance(metric, dict) or "name" not in metric or goal not in ("minimize", "maximize"):
        raise ConfigError(
            f'metric in {path} must be {{ name = "loss", goal = "minimize" }} (goal '
            f"minimize or maximize), got {metric!r}"
        )
    parameters = cfg.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise ConfigError(
            f"{path} has no [parameters]: give at least one, e.g. lr = {{ values = [1e-3, 3e-3] }}"
        )
    for key, why in _NOT_PARAMETERS.items():
        if key in parameters:
            raise ConfigError(f"{key} in {path}'s parameters: {why}")
    for name, spec in parameters.items():
        _check_parameter(name, spec, method, path)
    run_cap = cfg.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or run_cap < 1):
        raise ConfigError(f"run_cap = {run_cap!r} in {path} must be a positive integer")
    if method == "random" and run_cap is None:
        raise ConfigError(f'method = "random" in {path} needs run_cap, the number of trials')
    sweep = Sweep(command, method, metric["name"], goal, parameters, run_cap, str(path))
    if method == "grid":  # the product's size, not the product
        grid = math.prod(len(_choices(spec)) for spec in parameters.values())
        count = min(grid, run_cap or grid)
    else:
        count = run_cap
    if count > MAX_TRIALS:
        raise ConfigError(
            f"{path} asks for {count:,} trials, more than a sweep holds ({MAX_TRIALS:,}: each "
            f"is a run directory, listed in sweep.json before the first runs); lower run_cap "
            f"or split the sweep"
        )
    return sweep


def _check_parameter(name: str, spec: Any, method: str, path: Path) -> None:
    where = f"parameter {name} in {path}"
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{where} must be a table such as {{ value = ... }} or {{ values = [...] }}"
        )
    kind = _distribution(spec)
    if kind not in _DISTRIBUTIONS:
        raise ConfigError(
            f"{where}: distribution {kind!r} is not one of {', '.join(_DISTRIBUTIONS)}"
        )
    if kind == "categorical" and (not isinstance(spec.get("values"), list) or not spec["values"]):
        raise ConfigError(f"{where}: values must be a non-empty list")
    if kind == "constant" and "value" not in spec:
        raise ConfigError(f"{where}: a constant needs value = ...")
    if kind in ("int_uniform", "uniform", "log_uniform_values", "q_uniform"):
        if method == "grid":
            raise ConfigError(
                f"{where}: a grid needs value or values; the {kind} distribution goes with "
                f'method = "random"'
            )
        low, high = spec.get("min"), spec.get("max")
        if (
            not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
            or low > high
        ):
            raise ConfigError(
                f"{where}: {kind} needs numbers min <= max, got min={low!r} max={high!r}"
            )
        if kind == "log_uniform_values" and low <= 0:
            raise ConfigError(f"{where}: log_uniform_values needs min > 0, got {low}")


def _distribution(spec: dict[str, Any]) -> str:
    if "distribution" in spec:
        return spec["distribution"]
    return "categorical" if "values" in spec else "constant"


def _choices(spec: dict[str, Any]) -> list[Any]:
    return spec["values"] if _distribution(spec) == "categorical" else [spec["value"]]


def _draw(spec: dict[str, Any], rng: np.random.Generator) -> Any:
    kind = _distribution(spec)
    if kind in ("constant", "categorical"):
        choices = _choices(spec)
        return choices[int(rng.integers(len(choices)))]
    low, high = spec["min"], spec["max"]
    if kind == "int_uniform":
        return int(rng.integers(low, high + 1))
    if kind == "uniform":
        return float(rng.uniform(low, high))
    if kind == "log_uniform_values":
        return float(math.exp(rng.uniform(math.log(low), math.log(high))))
    q = spec.get("q", 1)
    return float(round(rng.uniform(low, high) / q) * q)


Trial = Callable[[dict[str, Any], Path], None]


def run_sweep(
    sweep: Sweep,
    out: Path,
    trial: Trial,
    count: int | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run the trials not yet finished (at most `count` of them) with `trial(params,
    run_dir)`; the sweep's table, best first. A trial that raises a `ShardemuError` is
    recorded as failed and the sweep goes on; it runs again when the sweep resumes. A
    trial stopped by a signal (`RunInterrupted`) stops the sweep: recorded as
    interrupted, it is raised on, with its exit status.
    `out` is new, empty, or this sweep's own directory (its `sweep.json`, written before
    the first trial, says so): a run's or another sweep's directory is refused whole."""
    spec = {k: v for k, v in sweep.__dict__.items() if k != "source"}
    index = out / "sweep.json"
    if out.exists() and not out.is_dir():
        raise RunDirError(f"`out` {out} is a file, not a directory; give a new `out`")
    if out.is_dir() and any(out.iterdir()) and not index.exists():
        raise RunDirError(
            f"`out` {out} holds files but no sweep.json: it is not a sweep's directory (a "
            f"run's?) and nothing in it is replaced; give a new `out`"
        )
    if index.exists() and json.loads(index.read_text()).get("sweep") != spec:
        raise ConfigError(
            f"{out} holds a different sweep ({index}); give another `out`, or the same sweep file"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(
            f"`out` {out}: cannot make the sweep's directory ({err.strerror})"
        ) from None
    trials = sweep.trials()
    rows = [
        {"trial": f"trial-{i:03d}", "parameters": params, "status": "not run"}
        for i, params in enumerate(trials)
    ]
    if not index.exists():  # the directory is this sweep's from now on
        _write_index(out, spec, sweep, rows)
    ran = 0
    for i, params in enumerate(trials):
        run_dir = out / rows[i]["trial"]
        done = run_dir / TRIAL_FILE
        if done.exists():
            rows[i] = _finished(done, params)
            continue
        if count is not None and ran >= count:
            continue
        if run_dir.exists():  # begun and not finished: start it again
            shutil.rmtree(run_dir)
        ran += 1
        row = {**rows[i], "run_dir": str(run_dir)}
        what = f"{run_dir.name} {_params_text(params, sweep.varied())}"
        try:
            trial(params, run_dir)
        except RunInterrupted as err:  # Ctrl-C or SIGTERM stops the sweep, not one trial
            rows[i] = row | {"status": "interrupted", "error": str(err)}
            _write_index(out, spec, sweep, rows)
            log(f"{what}: interrupted; the same command resumes the sweep")
            raise
        except ShardemuError as err:
            row |= {"status": "failed", "error": str(err)}
            log(f"{what}: failed: {err}")
        else:
            row |= {"status": "finished", sweep.metric: _metric(run_dir, sweep.metric)}
            done.write_text(json.dumps(row, indent=2) + "\n")
            log(f"{what}: {sweep.metric} {fmt_value(row[sweep.metric])}")
        rows[i] = row
        _write_index(out, spec, sweep, rows)
    return _write_index(out, spec, sweep, rows)


def _finished(done: Path, params: dict[str, Any]) -> dict[str, Any]:
    """A finished trial's row, which must be of these parameters (as JSON holds them)."""
    row = json.loads(done.read_text())
    if row.get("parameters") != json.loads(json.dumps(params)):
        raise ConfigError(
            f"{done} finished with parameters {row.get('parameters')}, but this sweep gives "
            f"{done.parent.name} {params}; give another `out`, or the sweep file it ran"
        )
    return row


def _metric(run_dir: Path, name: str) -> float:
    """The metric in the trial's last metrics.jsonl record."""
    records = read_metrics(run_dir)
    final = scalars(records[-1]) if records else {}
    if name not in final:
        raise ConfigError(
            f"metric {name!r} is not in {run_dir}/metrics.jsonl; its fields are "
            f"{', '.join(sorted(final))}"
        )
    return final[name]


def _params_text(params: dict[str, Any], names: list[str]) -> str:
    return " ".join(f"{n}={fmt_value(params[n])}" for n in names)


def ranked(rows: list[dict[str, Any]], metric: str, goal: str) -> list[dict[str, Any]]:
    """Finished trials best first, then the others in trial order."""
    sign = 1 if goal == "minimize" else -1
    finished = sorted(
        (r for r in rows if r["status"] == "finished"), key=lambda r: sign * r[metric]
    )
    return finished + [r for r in rows if r["status"] != "finished"]


def _write_index(
    out: Path, spec: dict[str, Any], sweep: Sweep, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    table = ranked(rows, sweep.metric, sweep.goal)
    (out / "sweep.json").write_text(json.dumps({"sweep": spec, "trials": table}, indent=2) + "\n")
    varied = sweep.varied()
    head = ["trial", "status", sweep.metric, *varied]
    lines = [
        f"# shardemu sweep: {sweep.source}\n",
        f"{sweep.method} over {', '.join(varied) or 'constants'}; {sweep.metric} "
        f"({sweep.goal}), best first\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in table:
        value = fmt_value(r[sweep.metric]) if sweep.metric in r else "-"
        cells = [r["trial"], r["status"], value, *(fmt_value(r["parameters"][n]) for n in varied)]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return table
