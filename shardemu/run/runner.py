"""A training run end to end: mesh, engine, the loop and its hooks (run directory,
trackers, checkpoints, the divergence check, progress), summary, and the prediction on
named hardware. `train` is the entry point; a `Run` holds one run's engine and records
(`record.py`) and trains it."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from shardemu.accounting.ledger import Event
from shardemu.accounting.ledger_file import write_ledger
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.data import make_corpus
from shardemu.errors import CheckpointError, NonFiniteError, RunInterrupted
from shardemu.models import Model, as_model, param_count
from shardemu.numerics.precision import arithmetic
from shardemu.parallel.mesh import mesh_from
from shardemu.parallel.rules import Rules
from shardemu.predict.costmodel import Timeline
from shardemu.predict.hardware import Hardware
from shardemu.report.rundir import RunDir, config_record, default_run_dir, read_metrics
from shardemu.report.trackers import Trackers, TrackingConfig, open_trackers
from shardemu.run.checkpoint import Checkpoints, shared_run_path
from shardemu.run.engine import make_engine
from shardemu.run.faults import StopSignals, abort_run, check_finite, resume_hint
from shardemu.run.loop import StepInfo, training_loop
from shardemu.run.record import (
    predict_step,
    prediction_files,
    read_ledger,
    run_config,
    run_summary,
)

# the files a run hands its trackers as artifacts, when it wrote them
RUN_FILES = ("config.json", "ledger.json", "summary.md", "trace.json", "timeline.png")


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float]
    summary: dict[str, Any]


@dataclass
class Resumed:
    """Where a run starts: the checkpoints it resumes from (none for a new run), the
    steps they hold, and the records and ledger events of those steps."""

    source: Checkpoints | None = None
    start: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    ledger: list[Event] = field(default_factory=list)
    run_dir: Path | None = None


def train(
    model: Model | ModelConfig,
    par: Parallelism,
    train_cfg: TrainConfig,
    out: str | Path | None = None,
    devices: Sequence[jax.Device] | None = None,
    rules: Rules | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    phased: PhasedConfig | None = None,
    hardware: Hardware | None = None,
    checkpoint_every: int | None = None,
    resume: str | Path | None = None,
    tracking: TrackingConfig | None = None,
    eval_every: int | None = None,
) -> RunResult:
    """Train `model` (a `Model`, your own family's included, or a registered family's
    config) on a `par` mesh for `train_cfg.steps` steps and record the run:
    resident (one compiled step), pipelined (pipe > 1 or microbatches > 1: the schedule
    executed stage by stage), or with `phased` weights in the host tier streamed in
    phase by phase. Every engine writes `ledger.json`; with `hardware`, every step is
    predicted on that hardware from its own ledger, and the last one drawn (trace.json,
    timeline.png).

    The run directory logs the config, every step and the summary; `tracking` adds
    W&B and TensorBoard beside it (`shardemu.report.trackers`). `checkpoint_every` K saves the
    state every K steps and at the end (`checkpoint.py`). `resume` continues the run
    directory `resume` from its last checkpoint (from step 0 when it has none), in place
    unless `out` names another directory; its settings must be the run's own
    (`resume_settings`), the mesh may differ. SIGINT or SIGTERM stop the run after the
    current step (`RunInterrupted`); a non-finite loss or gradient norm stops it with
    `NonFiniteError`. `on_step` sees every step's record."""
    model = as_model(model)
    run = Run(
        model,
        par,
        train_cfg,
        devices,
        rules,
        phased,
        hardware,
        checkpoint_every,
        tracking,
        eval_every,
    )
    resumed = run.resume_from(resume) if resume is not None else Resumed()
    out = Path(out or resume or default_run_dir(model.name))
    reopen = resume is not None and out.resolve() == Path(resume).resolve()
    # a signal is a stop request from before the run directory is claimed: one that came
    # between the two used to kill the process and leave the directory locked
    with StopSignals() as signals:
        return run.execute(RunDir(out, reopen=reopen), resumed, on_step, signals)


class Run:
    """One run's engine and what its run directory records; `execute` trains it."""

    def __init__(
        self,
        model: Model,
        par: Parallelism,
        train_cfg: TrainConfig,
        devices: Sequence[jax.Device] | None,
        rules: Rules | None,
        phased: PhasedConfig | None,
        hardware: Hardware | None,
        checkpoint_every: int | None,
        tracking: TrackingConfig | None,
        eval_every: int | None,
    ) -> None:
        """Every setting is checked and the engine built before anything is written."""
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ConfigError(
                f"`checkpoint_every` must be a positive number of steps, got {checkpoint_every}"
            )
        if tracking is not None:
            tracking.check_installed()
        if eval_every is not None and eval_every < 1:
            raise ConfigError(f"`eval_every` must be a positive number of steps, got {eval_every}")
        _check_host_memory(model.cfg, train_cfg)
        make_corpus(train_cfg.data, model.cfg.vocab_size, train_cfg.seed)  # refused now if
        # the vocabulary cannot hold its tokens, not after compiling (its text is cached)
        if hardware is not None:  # predicted at the run's precision's peak
            hardware = hardware.at_precision(arithmetic(model.cfg, train_cfg.precision))
        self.par, self.train_cfg, self.hardware = par, train_cfg, hardware
        self.checkpoint_every, self.tracking, self.eval_every = (
            checkpoint_every,
            tracking,
            eval_every,
        )
        self.mesh = mesh_from(par, devices)
        self.model = model
        self.engine = make_engine(self.model, self.mesh, train_cfg, phased, rules)
        self.phase_plan = self.engine.trainer.plan() if phased else None  # one abstract step
        self.sizes = {
            "param_count": param_count(self.model.abstract_params()[0]),
            **self.engine.sizes(),
        }
        self.config = run_config(
            self.model,
            self.engine,
            self.mesh,
            train_cfg,
            phased,
            self.phase_plan,
            self.sizes,
            rules,
        )
        # what a checkpoint must match to be restored: the engine and how it splits layers
        self.layout: dict[str, Any] = {
            "engine": self.engine.name,
            "stage_plan": [s["layers"] for s in self.config["stage_plan"]],
        }
        if phased:
            self.layout["phases"] = [list(s) for s in self.engine.trainer.slices]
        self.saved: Checkpoints | None = None  # the run's own checkpoints, once made

    def resume_from(self, resume: str | Path) -> Resumed:
        """The run directory `resume`: its checkpoints, records and ledger. Where it goes
        on from (the newest checkpoint that restores whole) is found when the state is
        restored (`_start`), before anything is written."""
        if not (Path(resume) / "config.json").is_file():
            raise CheckpointError(
                f"`resume` {resume}: no run directory there (no config.json); give a run "
                f"directory that shardemu run wrote"
            )
        source = Checkpoints(resume, self.engine.stage_meshes())
        latest = source.latest() or 0
        if latest >= self.train_cfg.steps:
            raise ConfigError(
                f"{resume} has a checkpoint after {latest} steps; give TrainConfig.steps more "
                f"than {latest}"
            )
        return Resumed(source, 0, read_metrics(resume), read_ledger(resume), Path(resume))

    def execute(
        self,
        run: RunDir,
        resumed: Resumed,
        on_step: Callable[[dict[str, Any]], None] | None,
        signals: StopSignals,
    ) -> RunResult:
        """Train into `run` from where `resumed` says, stopping where `signals` (entered)
        asks; a run that fails before its first step leaves no directory behind, and the
        trackers and checkpoints always close."""
        signals.on_abort = lambda: abort_run(run)
        trackers: Trackers | None = None
        try:
            # the state first: a resume that cannot restore it changes no file
            state, compile_s, resumed = self._start(resumed, run)
            for record in resumed.records:
                run.log(record)
            trackers = open_trackers(self.tracking, run)
            trackers.log_config(config_record(self._config_record(resumed)))
            state, records = self._train(state, resumed, run, trackers, on_step, signals)
            return self._finish(run, trackers, resumed, state, records, compile_s, signals)
        except NonFiniteError as err:
            run.write_summary(f"# shardemu run: {self.model.cfg.name}\n\nstopped: {err}\n")
            raise
        except BaseException:
            run.discard_if_empty()
            raise
        finally:
            if trackers is not None:
                trackers.finish()
            run.finish()
            for checkpoints in (resumed.source, self.saved):
                if checkpoints is not None:
                    checkpoints.close()

    def _config_record(self, resumed: Resumed) -> dict[str, Any]:
        """config.json: the run's settings, and where a resumed run came from."""
        return {
            **self.config,
            "checkpoint_every": self.checkpoint_every,
            "eval_every": self.eval_every,
            "hardware": self.hardware.name if self.hardware is not None else None,
            "tracking": dataclasses.asdict(self.tracking or TrackingConfig()),
            **(
                {"resumed_from": {"run_dir": str(resumed.run_dir), "steps_done": resumed.start}}
                if resumed.run_dir is not None
                else {}
            ),
        }

    def _start(self, resumed: Resumed, run: RunDir) -> tuple[Any, float, Resumed]:
        """The engine's first state, or the newest whole checkpoint's, with the records
        and ledger of the steps before it; the seconds to compile."""
        t0 = time.perf_counter()
        state = self.engine.init(self.train_cfg.seed)  # pipelined and phased compile later
        compile_s = time.perf_counter() - t0
        if resumed.source is None:
            return state, compile_s, resumed
        here = resumed.run_dir is not None and run.path.resolve() == resumed.run_dir.resolve()
        start, state = resumed.source.restore_newest(state, self.layout, set_aside=here)
        self.engine.start_at(start)
        resumed = dataclasses.replace(
            resumed,
            start=start,
            records=[r for r in resumed.records if r["step"] < start],
            ledger=[e for e in resumed.ledger if e.step < start],
        )
        return state, compile_s, resumed

    def _train(
        self,
        state: Any,
        resumed: Resumed,
        run: RunDir,
        trackers: Trackers,
        on_step: Callable[[dict[str, Any]], None] | None,
        signals: StopSignals,
    ) -> tuple[Any, list[dict[str, Any]]]:
        """The loop with its hooks, from `state`: the last state and the records of the
        steps it ran."""
        # made once the state is, so a run that fails before it leaves nothing behind
        saved = self.saved = (
            Checkpoints(shared_run_path(run.path), self.engine.stage_meshes())
            if self.checkpoint_every
            else None
        )
        loop = training_loop(
            self.model, self.engine, self.par, self.train_cfg, self._predictor(), self.eval_every
        )
        loop.add_hook(lambda info: trackers.log(info.record, info.step))
        loop.add_hook(lambda info: check_finite(info.record, self.train_cfg.learning_rate))
        if on_step is not None:
            loop.add_hook(lambda info: on_step(info.record))
        if saved is not None:

            def checkpoint(info: StepInfo) -> None:
                """The state, and the ledger so far: a run killed later resumes with
                every step's events, as it does with every step's metrics."""
                saved.save(info.step + 1, info.result.state, self.layout)
                write_ledger(
                    run.path / "ledger.json", [*resumed.ledger, *self.engine.ledger.events]
                )

            loop.add_hook(checkpoint, every=self.checkpoint_every)  # type: ignore[arg-type]
        state, records = loop.run(state, self.train_cfg.steps, resumed.start, signals.requested)
        return state, records

    def _predictor(self) -> Callable[[int], tuple[Timeline, dict[str, Any]]] | None:
        """Step -> its prediction on the run's hardware (none without hardware)."""
        if self.hardware is None:
            return None
        return functools.partial(
            predict_step,
            self.engine,
            self.phase_plan,
            self.hardware,
            self.par,
            tokens=self.train_cfg.tokens,
        )

    def _finish(
        self,
        run: RunDir,
        trackers: Trackers,
        resumed: Resumed,
        state: Any,
        records: list[dict[str, Any]],
        compile_s: float,
        signals: StopSignals,
    ) -> RunResult:
        """After the loop: the summary, the ledger, the last step's prediction and
        views; a stopped run checkpoints where it stopped and says how to go on."""
        done, stopped, saved = resumed.start + len(records), signals.received, self.saved
        if stopped is not None and run.logged == 0:
            raise RunInterrupted(
                f"{signal.Signals(stopped).name} before the first step finished: nothing "
                f"was written",
                stopped,
            )
        if stopped is not None and saved is not None and saved.latest() != done:
            saved.save(done, state, self.layout)
        every = resumed.records + records
        summary = run_summary(
            self.model.cfg,
            self.par,
            self.train_cfg,
            self.mesh.size,
            every,
            compile_s,
            run.path,
            self.sizes,
        )
        summary["status"] = "completed" if stopped is None else f"interrupted at step {done}"
        write_ledger(run.path / "ledger.json", [*resumed.ledger, *self.engine.ledger.events])
        predictor = self._predictor()
        if predictor is not None and records:
            timeline, report = predictor(done - 1)
            summary.update(
                prediction_files(timeline, report, run.path, self.model.cfg.name, self.par)
            )
        trackers.log_summary(summary)
        trackers.log_artifacts([run.path / name for name in RUN_FILES])
        if stopped is not None:
            raise RunInterrupted(resume_hint(stopped, run.path, done, saved is not None), stopped)
        return RunResult(run.path, [r["loss"] for r in every], summary)


def _check_host_memory(model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
    """Refuse a run whose batch cannot fit this machine: one layer's input activations
    (batch x seq x width float32 values, all virtual devices together) is a floor on
    what a step holds."""
    floor = train_cfg.batch * train_cfg.seq * model_cfg.embed_dim * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if floor > memory:
        raise ConfigError(
            f"TrainConfig.batch {train_cfg.batch} x TrainConfig.seq {train_cfg.seq} of "
            f"{model_cfg.name} needs at "
            f"least {floor:,} bytes for one layer's activations, more than this machine's "
            f"{memory:,}; run a smaller batch, or count it with `shardemu plan`"
        )
