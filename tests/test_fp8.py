"""`--precision fp8`: the layers' matmuls on FP8 operands with per-tensor current
scaling (`models/fp8.py`), timed at the profile's FP8 peak (`roofline.py`).

Witnesses: the FP8 product against the exact product of hand-quantized operands (NumPy
rounding through ml_dtypes, sharing no code with `fp8.quantize`); a sharded product
against the unsharded one; a sharded FP8 training run against the hand-written BF16
reference of test_precision.py within a stated tolerance; the HLO's FP8 dots against
the layers' matmul count; the roofline of a hand-built event against the hand sum.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_precision import train_cfg

from shardemu.accounting.count import Counter
from shardemu.accounting.ledger import Event, Matmul, Phase
from shardemu.cli import main
from shardemu.errors import HardwareError
from shardemu.models import Model, fp8, get_preset
from shardemu.parallel.mesh import make_mesh
from shardemu.predict.hardware import Hardware
from shardemu.predict.profiles import PROFILES
from shardemu.predict.roofline import least_step_seconds, run_seconds
from shardemu.resident.trainer import Trainer


def by_hand(x: np.ndarray, fmt) -> np.ndarray:
    """x scaled so that its largest |element| is the format's largest value, rounded to
    the format (ml_dtypes' cast), and scaled back: what FP8 keeps of x."""
    limit = float(ml_dtypes.finfo(fmt).max)
    scale = np.float32(limit / np.abs(x).max())
    return (x * scale).astype(fmt).astype(np.float32) / scale


def test_the_fp8_product_is_the_product_of_the_quantized_operands():
    """Forward: x and w in E4M3; backward: the output gradient in E5M2, each input
    gradient the product of the quantized gradient with the other quantized operand.
    Each within 1e-5 of the hand computation (the scales differ from the hand's only in
    how float32 rounds 448 / amax), and the forward within 10% of the exact product."""
    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal(s).astype(np.float32) for s in ((8, 32), (32, 16), (8, 16)))
    xh, wh, gh = by_hand(x, ml_dtypes.float8_e4m3fn), by_hand(w, ml_dtypes.float8_e4m3fn), None
    gh = by_hand(g, ml_dtypes.float8_e5m2)
    y, vjp = jax.vjp(lambda a, b: fp8.einsum("bd,df->bf", a, b, True), x, w)
    dx, dw = vjp(jnp.asarray(g))
    np.testing.assert_allclose(y, xh @ wh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, gh @ wh.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, xh.T @ gh, rtol=1e-5, atol=1e-5)
    assert np.abs(y - x @ w).max() < 0.1 * np.abs(x @ w).max()
    assert not np.allclose(y, x @ w, rtol=1e-3)  # it did quantize


def test_a_sharded_fp8_product_quantizes_as_one_device_does():
    """The amax is the whole tensor's, over every device: a product split over batch
    and tensor equals the unsplit one exactly."""
    m = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    f = jax.jit(jax.value_and_grad(lambda a, b: fp8.einsum("bd,df->bf", a, b, True).sum() ** 2))
    sharded = f(
        jax.device_put(x, NamedSharding(m, P("replica", None))),
        jax.device_put(w, NamedSharding(m, P(None, "tensor"))),
    )
    whole = f(x, w)
    np.testing.assert_array_equal(np.asarray(sharded[0]), np.asarray(whole[0]))
    np.testing.assert_array_equal(np.asarray(sharded[1]), np.asarray(whole[1]))


def test_an_fp8_plan_times_each_layer_matmul_at_the_fp8_peak(capsys, tmp_path):
    """gpt-tiny's step in FP8: each layer's four projections (QKV, attention out, MLP
    in and out) are FP8 dots in the forward pass, and their input and weight gradients
    (eight) in the backward; the attention core's two dots (four backward) and the
    head's (one, two backward) are not. On an A100, which has no FP8, the plan is
    refused with the profile's precisions named."""
    model = Model(get_preset("gpt-tiny"))
    m = make_mesh(devices=jax.devices()[:1])
    (step,) = [e for e in Trainer(model, m, train_cfg("fp8")).step_events(Counter(), 0)
               if e.phase.kind == "step"]  # fmt: skip
    fp8_dots = [m.fp8 for m in step.matmuls]
    layers = model.cfg.num_layers
    assert (sum(fp8_dots), len(fp8_dots) - sum(fp8_dots)) == (12 * layers, 6 * layers + 3)
    argv = ["plan", "--model", "gpt-tiny", "--hardware", "a100-80gb", "--precision", "fp8"]
    assert main([*argv, "--out", str(tmp_path / "a100")]) == 2
    assert "does not compute in --precision fp8; it supports fp32, bf16, fp16-mixed" in (
        capsys.readouterr().err
    )


def test_the_roofline_runs_each_matmul_at_its_kernels_rate():
    """One run of a hand-built piece on the H100 (`hardware.MEASURED_KERNELS_H100`): an
    FP8 matmul of 2e12 FLOPs (at 1979 x 0.65 TFLOP/s), a BF16 one of 1e12 (at 989 x
    0.73), a causal fused attention core's of 4e11 computing half of them (at 989 x
    0.55), the same core unfused (all its FLOPs, at 989 x 0.73), each plus 13.5 us,
    and 1e9 FLOPs over 3.35e9 bytes of other kernels (memory-bound at 3350 x 0.83
    GB/s). Without a roofline (`memory_gbps` left out) the same FLOPs at the same rates,
    the rest at the BF16 rate."""
    h100 = PROFILES["h100-sxm"]
    core = Matmul(4e11, 10**6, attention=True, share=0.5, fused=True)
    unfused = core._replace(share=1.0, fused=False)
    matmuls = (Matmul(2e12, 10**6, True), Matmul(1e12, 10**6), core, unfused)
    seconds = run_seconds(3.8e12 + 1e9, matmuls, 3_350_000_000, h100)
    by_hand = (2e12 / 1979e12 / 0.65 + 1e12 / 989e12 / 0.73 + 2e11 / 989e12 / 0.55
               + 4e11 / 989e12 / 0.73)  # fmt: skip
    assert seconds == pytest.approx(by_hand + 4 * 13.5e-6 + 1e-3 / 0.83, rel=1e-12)
    left_out = PROFILES["tpu-v5p"].kernel_efficiencies()  # no figures of its own
    assert left_out == {"matmul": 0.73, "fused_attention": 0.73, "fp8": 0.73}
    flat = dataclasses.replace(h100, memory_gbps=None)
    rest = 1e9 / 989e12 / 0.73
    assert run_seconds(3.8e12 + 1e9, matmuls, 0, flat) == pytest.approx(by_hand + rest, rel=1e-12)
    event = Event(0, Phase("forward", 0), "compute", "activations", flops=1.0, run_flops=1.0,
                  matmuls=(Matmul(1.0, 1, True),))  # fmt: skip
    assert event.matmuls[0].fp8
    with pytest.raises(HardwareError, match="'a100-80gb' has no FP8 matmul peak"):
        run_seconds(2e12, matmuls[:1], 0, PROFILES["a100-80gb"])
    bound = least_step_seconds(3e12, 1, h100, fp8=True)
    assert bound == pytest.approx(3e12 / (1979e12 * 0.65)) and bound < seconds
    assert least_step_seconds(3e12, 1, h100) == pytest.approx(3e12 / (989e12 * 0.73))


def test_fp8_profiles_and_their_refusals():
    """H100 and H200 1979 TFLOP/s FP8 dense, B200 4500, GB200 5000 (datasheets); A100 and the TPUs
    list no fp8. A profile naming fp8 without its peak (or the other way) is refused."""
    assert {n: p.fp8_tflops for n, p in PROFILES.items() if "fp8" in p.precisions} == {
        "h100-sxm": 1979.0, "h200-sxm": 1979.0, "b200": 4500.0, "gb200-nvl72": 5000.0,
    }  # fmt: skip
    assert PROFILES["h100-sxm"].at_precision("fp8").peak_tflops == 989.0  # the 16-bit kernels
    plain = Hardware("x", 10.0, 1, 1, 1, 1, 1, 1)
    with pytest.raises(HardwareError, match="give both, or neither"):
        dataclasses.replace(plain, precisions=("bf16", "fp8"))
    with pytest.raises(HardwareError, match="give both, or neither"):
        dataclasses.replace(plain, fp8_tflops=20.0)
    assert dataclasses.replace(plain, precisions=("bf16", "fp8"), fp8_tflops=20.0).fp8_tflops == 20


def test_an_fp8_layout_times_its_kernels_as_a_fused_stack_runs_them():
    """FP8's amax and casts are fused into their neighbours on the stacks that train in
    it (`Hardware.fp8_kernel_fusion`): the profile's other precisions keep its
    `kernel_fusion`, and a profile may say otherwise for FP8 (a stack that casts in
    passes of their own); an unknown value is refused, naming the choices."""
    h100 = PROFILES["h100-sxm"]
    fusion = {p: h100.at_precision(p).kernel_fusion for p in ("fp32", "bf16", "fp16-mixed", "fp8")}
    assert fusion == {"fp32": "emitted", "bf16": "emitted", "fp16-mixed": "emitted", "fp8": "fused"}
    naive = dataclasses.replace(h100, fp8_kernel_fusion="emitted")
    assert naive.at_precision("fp8").kernel_fusion == "emitted"
    with pytest.raises(HardwareError, match="fp8_kernel_fusion must be one of emitted, fused"):
        dataclasses.replace(h100, fp8_kernel_fusion="te")


MEASURED_FP8 = Path(__file__).parent.parent / "benchmarks" / "measured" / "torch_fp8_forward.json"


def test_an_fp8_layer_forward_is_timed_as_a_fused_stack_ran_it():
    """Llama 3 8B's layer forward with FP8 projections (2 x 8192 tokens) as measured on
    an H100 through `torch.compile` with its weights cast once, TE's way
    (`benchmarks/torch_fp8_forward.py --compile`: 9.1 ms a layer), against the
    `h100-sxm` roofline's forward piece in FP8, its kernels fused (`fp8_kernel_fusion`:
    10.0 ms; the piece also saves what the backward needs, so it sits above a forward
    without gradients): within 12%, where the count as XLA's CPU emits it (12.2 ms) is
    a third over. Two witnesses, nothing fitted to this layer."""
    from shardemu.config import Parallelism
    from shardemu.models import as_model
    from shardemu.predict.resident_count import count_key, counted_microbatch
    from shardemu.predict.roofline import compute_seconds

    runs = json.loads(MEASURED_FP8.read_text())
    measured = runs["fp8_cached_compiled_fwd_seconds"] / runs["layers"]
    key = count_key(
        as_model(get_preset("llama3-8b")), Parallelism(), 2, 8192, "none", "fp8", "fused"
    )
    forward = [e for e in counted_microbatch(key).pieces["forward"] if e.kind == "compute"]

    def seconds(hw: Hardware) -> float:
        return sum(compute_seconds(e, hw.at_precision("fp8")) for e in forward)

    h100 = PROFILES["h100-sxm"]
    assert seconds(h100) == pytest.approx(measured, rel=0.12)
    assert seconds(dataclasses.replace(h100, fp8_kernel_fusion="emitted")) > 1.25 * measured


def test_weight_casts_are_counted_apart_and_timed_once_a_step():
    """Transformer Engine under Megatron-Core casts a weight to FP8 at a step's first
    microbatch and keeps the copy (`accounting/cached_casts.py`). A count told which
    arrays are the weights splits a piece's kernels exactly: those on the weights alone
    (the amax, scale and cast, at least 3 bytes an element: one read of BF16, one FP8
    write) and the rest, whose sum is the whole count's. A resident plan in FP8 times
    them with the layer's update, which is otherwise BF16's; under ZeRO stage 3, which
    gathers the weights for each microbatch, in the forward and the backward again."""
    from shardemu.accounting.cached_casts import CachedWeights
    from shardemu.config import Parallelism
    from shardemu.predict.resident_count import count_key, counted_microbatch
    from shardemu.predict.zero import placed_casts

    mesh = make_mesh(devices=jax.devices()[:1])
    one = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=one)
    w = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16, sharding=one)

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(fp8.einsum("td,df->tf", x, w, True).astype(jnp.float32) ** 2)

    piece = jax.jit(jax.grad(loss, argnums=(0, 1)))
    whole = Counter().count("piece", piece, mesh, (x, w))
    split = Counter().count(
        "piece", piece, mesh, (x, w), (CachedWeights.of(w, frozenset({"piece"})),)
    )
    assert whole.cast_bytes == (0, 0) and split.cast_bytes[0] >= 3 * 128 * 512
    assert split.memory_bytes + split.cast_bytes[0] == whole.memory_bytes

    model = Model(get_preset("llama-tiny"))
    fp8_mb, bf16_mb = (
        counted_microbatch(count_key(model, Parallelism(), 2, 32, "none", p, "materialized"))
        for p in ("fp8", "bf16")
    )
    once, gathered = placed_casts(fp8_mb), placed_casts(dataclasses.replace(fp8_mb, zero_stage=3))

    def moved(mb, piece: str) -> int:  # noqa: ANN001
        return next(e.memory_bytes for e in mb.pieces[piece] if e.kind == "compute")

    weights = sum(x.size for x in jax.tree.leaves(model.abstract_params()[0][model.stack_key]))
    assert moved(once, "update0") - moved(bf16_mb, "update0") >= 3 * weights // model.cfg.num_layers
    assert moved(once, "forward") == moved(fp8_mb, "forward")
    # under ZeRO 3 the weights are gathered for each microbatch: cast in each forward
    assert moved(gathered, "update0") == moved(bf16_mb, "update0")
    assert (
        moved(gathered, "forward") - moved(fp8_mb, "forward") >= 3 * weights // model.cfg.num_layers
    )
