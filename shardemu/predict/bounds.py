"""What no layout can beat, for the search (`search.py`, whose docstring numbers the
prunes). With nothing compiled: a precision's least step, its model FLOPs at the
compute rate, and a resident layout's, its last stage's layers with the pipeline's fill
and drain (prune 5); a resident layout's least device bytes (prunes 2 and 5); whether
a mode can fit a mesh at all (prune 1). With its microbatch counted but no step timed: a
resident layout's busiest stream over the step (prune 6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax.numpy as jnp

from shardemu.accounting import flops
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.errors import CapacityError
from shardemu.models import Model, count_params
from shardemu.numerics.precision import arithmetic, compute_model
from shardemu.parallel.rules import Rules, rules_or_default
from shardemu.pipelined.layout import Split
from shardemu.predict.hardware import Hardware
from shardemu.predict.layouts import STATE_BYTES_PER_PARAM, Candidate, Mode, Space, meshes
from shardemu.predict.microbatch import microbatch_candidates
from shardemu.predict.plan_resident import CountedLayout, counted_layout
from shardemu.predict.resident_memory import device_bytes_at_least
from shardemu.predict.roofline import least_step_seconds
from shardemu.predict.rows import SearchRow
from shardemu.predict.twins import Twins


@dataclasses.dataclass
class Bounds:
    """A search's inputs, checked, and the bounds it prunes by."""

    model: Model
    hardware: Hardware
    devices: int
    batch: int
    seq: int
    space: Space
    top: int = 5  # the layouts the search ranks: prune 5 keeps any that could be among them
    rules: Rules | None = None  # None: Megatron-LM's

    def __post_init__(self) -> None:
        if self.devices < 1 or self.batch < 1 or self.seq < 1:
            raise ConfigError(
                f"`devices`, `batch` and `seq` must be positive, got {self.devices}, "
                f"{self.batch}, {self.seq}"
            )
        self.model.check_fits(TrainConfig(batch=self.batch, seq=self.seq), Parallelism())
        for precision in self.space.precisions:  # refuses a precision the profile lacks
            self.hardware.at_precision(arithmetic(self.model.cfg, precision))
        self.params = count_params(self.model)
        two = self.model.replace(num_layers=2)
        self.layer_params = count_params(two) - count_params(two.replace(num_layers=1))
        self.least_flops = flops.least_training_flops(self.model, self.batch, self.seq)
        self.found: list[SearchRow] = []  # the fitting rows found so far
        self._least_bytes: dict[Candidate, int | None] = {}
        self._layout: tuple[Candidate, CountedLayout | None] | None = None  # the last one
        self.twins = Twins(self.layout)  # layouts timed, for their twins (`twins.py`)

    def resident_rules(self, par: Parallelism) -> Rules:
        """The rules resident layout `par`'s counts and bounds use (`plan_resident`'s
        default: key/value heads replicated where `par.tensor` does not divide them)."""
        return rules_or_default(
            self.rules,
            self.space.sequence_parallel,
            context=par.context,
            tensor=par.tensor,
            kv_heads=self.model.cfg.kv_heads,
        )

    def train_config(self, c: Candidate, microbatches: int) -> TrainConfig:
        """`c`'s training settings with `microbatches` microbatches (or passes), and the
        space's sequence parallelism for a resident one."""
        train = c.train_config(c.microbatch_size * c.replica * microbatches, self.seq)
        if c.mode == "resident" and self.space.sequence_parallel:
            train = dataclasses.replace(train, sequence_parallel=True)
        return train

    def layout(self, c: Candidate) -> CountedLayout | None:
        """Resident `c`'s layout counted with its step's microbatches, no step timed
        (`counted_layout`); None where its plan would be refused or not fit. The last
        candidate's is kept: prune 6 (`least_resident`) and then its twins' lookup
        (`twins.py`) ask for the same one in turn."""
        if self._layout is not None and self._layout[0] == c:
            return self._layout[1]
        train = self.train_config(c, self.microbatches(c))
        try:
            layout = counted_layout(
                self.model, c.par, train, c.microbatch_size, self.hardware, c.recompute,
                self.space.overlap, self.space.attention, True, self.rules,
            )  # fmt: skip
        except (CapacityError, ConfigError):
            layout = None
        self._layout = (c, layout)
        return layout

    def least_resident(self, c: Candidate) -> tuple[float, int] | None:
        """Resident `c`'s step bound (`CountedLayout.least_step`) and device bytes for
        prune 6; None where its plan would be refused or not fit."""
        layout = self.layout(c)
        if layout is None:
            return None
        # an extrapolated step (`periodic.py`) may round below the exact bound
        return layout.least_step(c.par, self.space.overlap) * (1 - 1e-6), layout.held

    def least_step(self, precision: str) -> float:
        """No layout in `precision` is faster (`roofline.least_step_seconds`)."""
        return self._least_seconds(self.least_flops, self.devices, precision)

    def _least_seconds(self, flops: float, devices: int, precision: str) -> float:
        """`roofline.least_step_seconds` of `flops` over `devices` at `precision`'s rates."""
        hw = self.hardware.at_precision(arithmetic(self.model.cfg, precision))
        return least_step_seconds(flops, devices, hw, precision == "fp8")

    def rate_classes(self) -> list[tuple[str, ...]]:
        """The space's precisions grouped by compute rate (the same least step),
        fastest first (prune 5)."""
        least = {p: self.least_step(p) for p in self.space.precisions}
        return [
            tuple(p for p in self.space.precisions if least[p] == step)
            for step in sorted(set(least.values()))
        ]

    def microbatches(self, c: Candidate) -> int:
        return self.batch // (c.replica * c.microbatch_size)

    def least_bytes(self, c: Candidate) -> int | None:
        """Resident `c`'s least device bytes (`device_bytes_at_least`: nothing
        compiled), for the step `screen` judges its memory by; None for a setting the
        planner refuses."""
        if c not in self._least_bytes:
            batch = c.microbatch_size * c.replica * min(self.microbatches(c), 2 * c.pipe)
            try:
                self._least_bytes[c] = device_bytes_at_least(
                    self.model,
                    c.par,
                    batch,
                    self.seq,
                    c.microbatch_size,
                    c.schedule,
                    c.virtual,
                    c.recompute,
                    c.precision,
                    self.space.attention,  # type: ignore[arg-type]
                    self.resident_rules(c.par),
                    c.zero,
                    Split(embedding=c.ends_in_split, loss=c.ends_in_split),
                )
            except ConfigError:
                self._least_bytes[c] = None
        return self._least_bytes[c]

    def may_fit_memory(self, least_bytes: int | None) -> bool:
        return least_bytes is not None and least_bytes <= self.hardware.device_memory_bytes

    def may_fit(self, c: Candidate) -> bool:
        """Whether resident `c` may fit the device (`least_bytes`) and is not ruled out
        by prune 5 (`behind`): whether its count may be needed."""
        return self.may_fit_memory(self.least_bytes(c)) and self.behind(c) is None

    def behind(self, c: Candidate) -> SearchRow | None:
        """Prune 5 (module docstring): resident `c`'s row when the layouts found so far
        (`found`) rule it out of the top and of the Pareto front by its precision's least
        step, or its pipeline's (`fill_and_drain`), and its least bytes, else None."""
        least, what = self.least_step(c.precision), f"its model FLOPs at {c.precision}'s rate"
        piped = self.fill_and_drain(c)
        if piped > least:
            least, what = piped, "its layers' FLOPs with the pipeline's fill and drain"
        if sum(r.step_time_s < least for r in self.found) < self.top:
            return None  # nothing traced
        least_bytes = self.least_bytes(c)
        if not self.may_fit_memory(least_bytes):
            return None  # over the memory: `screen` says so, with nothing compiled
        return self.beaten(c, least, least_bytes, what)

    def fill_and_drain(self, c: Candidate) -> float:
        """No step of resident `c` is faster, with nothing compiled: its last stage's
        devices compute their layers' share of the least FLOPs of every one of the m
        microbatches (`flops.least_layer_training_flops`, the recomputed forward with
        full recomputation) and the head's (at the fastest kernel's rate over a
        microbatch's tensor x context devices: `least_step_seconds`), after the
        first microbatch's forward through the p - 1 model chunks before theirs, and
        their last computation (a backward of their first chunk, in every schedule:
        `parallel/schedules.py`) precedes the backward through those p - 1 chunks: m v
        + p - 1 chunks' computations one after another (Narayanan et al. 2021, §2.2:
        the bubble of (p - 1) / v microbatches). 0 (no bound) for a phased layout and for
        chunks the layers do not fill evenly (the embedding and the loss in the split).
        Less 1e-6: an extrapolated step (`periodic.py`) may round below it."""
        layers, chunks = self.model.cfg.num_layers, c.pipe * c.virtual
        if c.mode != "resident" or c.ends_in_split or layers % chunks:
            return 0.0
        b, m = c.microbatch_size, self.microbatches(c)
        chunk = flops.least_layer_training_flops(self.model, b, self.seq, c.recompute == "full")
        head = 3 * sum(flops.head_forward(self.model, b, self.seq).values())
        work = (m * c.virtual + c.pipe - 1) * chunk * (layers // chunks) + m * head
        return self._least_seconds(work, c.tensor * c.context, c.precision) * (1 - 1e-6)

    def search_order(self, pars: list[Parallelism]) -> list[Parallelism]:
        """The meshes, the least 1F1B bubble first ((p - 1) / m at microbatches of one
        sequence, m = batch / replica: `fill_and_drain` over the layers' share), so that
        the fastest layouts tend to be found first and prune 5 drops more of the rest
        before they are counted. The results do not depend on the order (each prune is
        exact); the rows are listed in `meshes`' order (`layouts.mesh_order`)."""

        def bubble(par: Parallelism) -> float:
            return (par.pipe - 1) * par.replica / self.batch

        return sorted(pars, key=bubble)

    def beaten(self, c: Candidate, least: float, least_bytes: int, what: str) -> SearchRow | None:
        """`c`'s row, pruned, where `top` layouts found (`found`) are faster than
        `least` seconds (`what` it is) and one of them holds no more than `least_bytes`:
        it can be neither among the top nor on the memory/time Pareto front. Else None."""
        faster = [r for r in self.found if r.step_time_s < least]
        if len(faster) < self.top:
            return None
        smaller = [r for r in faster if r.measures and r.measures.device_bytes <= least_bytes]
        if not smaller:
            return None
        d = min(smaller, key=lambda r: r.step_time_s)
        why = (
            f"at least {least:.4g} s ({what}) and {least_bytes / 1e9:.4g} GB a device: "
            f"{len(faster)} layouts are faster, and {d.label} takes {d.step_time_s:.4g} s in "
            f"{d.device_bytes / 1e9:.4g} GB"
        )
        return SearchRow.of(
            c,
            "pruned",
            microbatches=self.microbatches(c),
            reason=why,
            least_step_time_s=least,
            device_bytes_at_least=least_bytes,
        )

    def mesh_plans(
        self, modes: tuple[Mode, ...], precisions: tuple[str, ...]
    ) -> Iterator[tuple[Parallelism, str, dict[Mode, str], list[int]]]:
        """In search order, each mesh and precision of `precisions`: the modes prune 1
        drops (with the reason) and the microbatch sizes to try."""
        space = self.space
        for par in self.search_order(
            meshes(
                self.model.cfg,
                self.devices,
                self.batch,
                space.max_tensor,
                space.context_sizes,
                self.seq,
            )
        ):
            sizes = [
                b
                for b in microbatch_candidates(self.batch // par.replica)
                if b <= self.space.max_microbatch
            ]
            for precision in precisions:
                yield par, precision, self.pruned_modes(par, precision, modes), sizes

    def pruned_modes(self, par: Parallelism, precision: str, modes: tuple[Mode, ...]) -> dict:
        """Prune 1, by mode: the reason no layout of `par` in `precision` can fit."""
        capacity, name = self.hardware.device_memory_bytes, self.hardware.name
        out = {}
        # a least bound under any ZeRO stage searched (stage 3 splits all of it over
        # replica x context)
        zero = par.replica * par.context if max(self.space.zero_stages) else 1
        state = self.params * STATE_BYTES_PER_PARAM / (par.pipe * par.tensor * zero)
        if "resident" in modes and state > capacity:
            over = "pipe x tensor" + (" x replica x context (ZeRO)" if zero > 1 else "")
            out["resident"] = (
                f"weights, gradients and Adam state ({STATE_BYTES_PER_PARAM} bytes x "
                f"{self.params:,} parameters over {over}) exceed {name}'s device memory"
            )
        dtype = compute_model(self.model, precision).cfg.param_dtype
        layer = self.layer_params * jnp.dtype(dtype).itemsize / par.tensor
        if "phased" in modes and layer > capacity:
            out["phased"] = (
                f"one layer's {precision} weights ({self.layer_params:,} parameters over "
                f"tensor), which a phase holds whole, exceed {name}'s device memory"
            )
        return out
