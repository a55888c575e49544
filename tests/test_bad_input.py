"""Every bad input is answered before anything is written: one line on stderr naming
the value and the fix, exit status 2, never a traceback. A table of named command
lines, a table of Python API calls, and a hypothesis search over command lines with
one field broken."""

import json
import math
import os
import re

import jax
import pytest
from cli_helpers import shardemu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import shardemu as api
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import Overlap
from shardemu.predict.profiles import get_hardware

GPT = ["run", "--model", "gpt-tiny", "--steps", "1", "--batch", "8", "--seq", "16"]
CUSTOM = ["run", "--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4"]
PHASED = ["plan", "--model", "gpt-tiny", "--phased"]
A100 = ["plan", "--model", "gpt-tiny", "--hardware", "a100-80gb"]
PIPE2 = ["--mesh", "pipe=2", "--microbatches", "2"]
SEARCH = ["search", "--model", "gpt-tiny", "--hardware", "a100-80gb", "--devices", "8"]


def row(name, args, message):
    return pytest.param(args, message, id=name)


CLI_ROWS = [
    # numbers: zero, negative, not finite, not a number; a zero is never "not given"
    row("steps-0", [*GPT, "--steps", "0"], "--steps must be a positive integer, got 0"),
    row("steps-negative", [*GPT, "--steps", "-1"], "steps must be a positive integer, got -1"),
    row("steps-text", [*GPT, "--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    row("batch-0", [*GPT, "--batch", "0"], "batch must be a positive integer, got 0"),
    row("seq-0", [*GPT, "--seq", "0"], "seq must be a positive integer, got 0"),
    row("seed-negative", [*GPT, "--seed", "-1"], "seed must be an integer >= 0, got -1"),
    row("seed-huge", [*GPT, "--seed", str(2**70)], "use 0 <= seed < 2**32"),
    row("microbatches-0", [*GPT, "--microbatches", "0"], "microbatches must be a positive"),
    row("grad-accum-0", [*GPT, "--grad-accum", "0"], "--grad-accum must be a positive integer"),
    row("lr-0", [*GPT, "--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    row("lr-negative", [*GPT, "--lr", "-1"], "--lr must be a finite number > 0"),
    row("lr-nan", [*GPT, "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    row("lr-inf", [*GPT, "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    row("lr-overflow", [*GPT, "--lr", "1e400"], "--lr must be a finite number > 0"),
    row("warmup-negative", [*GPT, "--warmup", "-1"], "--warmup must be an integer >= 0"),
    row("devices-0", [*GPT, "--devices", "0"], "needs a positive device count, got 0"),
    row("devices-negative", [*GPT, "--devices", "-2"], "needs a positive device count, got -2"),
    row("devices-mismatch", [*GPT, "--mesh", "tensor=2,replica=2", "--devices", "3"],
        "needs 4 device(s) but 3 were given"),  # fmt: skip
    row("devices-8-for-4", [*GPT, "--mesh", "tensor=2,replica=2", "--devices", "8"],
        "needs 4 device(s) but 8 were given"),  # fmt: skip
    row("vocab-0", [*CUSTOM, "--vocab", "0"], "--vocab must be a positive integer, got 0"),
    row("vocab-negative", [*CUSTOM, "--vocab", "-1"], "--vocab must be a positive integer"),
    row("layers-0", [*CUSTOM[:4], "0", *CUSTOM[5:]], "layers must be a positive integer, got 0"),
    row("hidden-not-heads", [*CUSTOM[:6], "65", *CUSTOM[7:]], "--hidden 65 is not divisible"),
    row("heads-0", [*CUSTOM[:8], "0"], "heads must be a positive integer, got 0"),
    row("custom-missing", ["run", "--model", "gpt"], "--model gpt needs --layers, --hidden"),
    row("preset-with-layers", [*GPT, "--layers", "2"],
        "--layers go with --model bert or --model gpt or --model llama or --model moe, "
        "not a preset"),  # fmt: skip
    row("no-model", ["run"], "the following argument is required: --model"),
    row("steps-past-int32", [*GPT, "--steps", "99999999999999999999"],
        "--steps 99999999999999999999 is more than the optimizer's int32 step count"),  # fmt: skip
    row("vocab-2", ["run", "--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--vocab", "2"], "--vocab 2 is too small for the synthetic corpus"),  # fmt: skip
    row("unknown-model", ["run", "--model", "gpt-9000"], "unknown model 'gpt-9000'"),
    row("pad-vocab-0", [*GPT, "--pad-vocab", "0"], "multiple must be a positive integer, got 0"),
    row("max-predictions-gpt", [*GPT, "--max-predictions", "4"],
        "--max-predictions goes with a BERT model"),
    row("max-predictions-0", ["run", "--model", "bert-tiny", "--max-predictions", "0"],
        "a positive number of positions, got 0 for bert-tiny"),  # fmt: skip
    row("pad-vocab-negative", [*GPT, "--pad-vocab", "-8"], "must be a positive integer, got -8"),
    row("pad-vocab-huge", [*GPT, "--pad-vocab", str(10**12)], "is larger than gpt-tiny's vocab"),
    row("describe-pad-vocab-0", ["describe", "--model", "gpt-tiny", "--pad-vocab", "0"],
        "must be a positive integer, got 0"),  # fmt: skip
    row("describe-unpadded", ["describe", "--model", "gpt2-small", "--mesh", "tensor=8"],
        "--pad-vocab"),  # fmt: skip
    # describe takes no --stage-layers: named as what a run or a resident plan may give
    row("describe-pipe-not-dividing", ["describe", "--model", "gpt-tiny", "--mesh", "pipe=3"],
        "a run or a resident plan may instead give each stage its layers"),  # fmt: skip
    row("optimizer-unknown", [*GPT, "--optimizer", "sgd"], "invalid choice: 'sgd'"),
    row("flag-unknown", [*GPT, "--lerning-rate", "1"], "unrecognized arguments: --lerning-rate"),
    row("flag-abbreviated", [*GPT, "--ste", "2"], "unrecognized arguments: --ste"),
    # meshes
    row("mesh-tensor-0", [*GPT, "--mesh", "tensor=0"], "tensor must be a positive integer, got 0"),
    row("mesh-negative", [*GPT, "--mesh", "tensor=-2"], "tensor must be a positive integer"),
    row("mesh-axis-unknown", [*GPT, "--mesh", "foo=2"], "bad mesh item 'foo=2'"),
    row("mesh-size-text", [*GPT, "--mesh", "tensor=two"], "needs an integer size, got 'two'"),
    row("mesh-axis-twice", [*GPT, "--mesh", "tensor=2,tensor=2"], "'tensor' given twice"),
    row("mesh-no-size", [*GPT, "--mesh", "pipe"], "bad mesh item 'pipe'"),
    row("mesh-heads-3", [*GPT, "--mesh", "tensor=3"], "is not divisible by mesh axis 'tensor'"),
    row("mesh-huge", [*GPT, "--mesh", "tensor=1048576"], "more than the 2048"),
    row("pipe-5", [*GPT, "--mesh", "pipe=5"], "4 layers do not split evenly over pipe=5"),
    row("pipe-3", ["run", "--model", "gpt-tiny", "--mesh", "pipe=3"],
        "give the layers of each stage with --stage-layers (e.g. 1,1,2)"),  # fmt: skip
    row("batch-replica", [*GPT, "--batch", "7", "--mesh", "replica=2"],
        "--batch 7 is not divisible by replica * expert = 2"),  # fmt: skip
    row("batch-replica-4", ["run", "--model", "gpt-tiny", "--mesh", "replica=4", "--batch", "6"],
        "--batch 6 is not divisible by replica * expert = 4"),  # fmt: skip
    row("batch-microbatches", [*GPT, "--microbatches", "3", "--mesh", "pipe=2"],
        "replica * expert * microbatches * grad_accum = 1 * 3 * 1 = 3"),  # fmt: skip
    row("batch-accum", [*GPT, "--grad-accum", "3"], "= 1 * 1 * 3 = 3; use a multiple of 3"),
    row("seq-huge", [*GPT, "--seq", "100000"], "--seq 100000 exceeds gpt-tiny's 128 positions"),
    row("bert-seq-4", ["run", "--model", "bert-tiny", "--seq", "4"], "need --seq >= 8, got 4"),
    # pipelines
    row("schedule-unknown", [*GPT, "--schedule", "foo"], "argument --schedule: invalid choice"),
    row("virtual-0", [*GPT, *PIPE2, "--schedule", "interleaved", "--virtual", "0"],
        "--virtual must be a positive integer, got 0"),  # fmt: skip
    row("virtual-negative", [*GPT, *PIPE2, "--schedule", "interleaved", "--virtual", "-1"],
        "virtual must be a positive integer, got -1"),  # fmt: skip
    row("virtual-1-interleaved", [*GPT, *PIPE2, "--schedule", "interleaved", "--virtual", "1"],
        "interleaved 1F1B needs --virtual >= 2"),  # fmt: skip
    row("virtual-without-interleaved", [*GPT, "--mesh", "pipe=2", "--virtual", "2"],
        "only the interleaved schedule runs; set --schedule interleaved"),  # fmt: skip
    row("virtual-not-dividing", [*GPT, *PIPE2, "--stage-layers", "1,3", "--schedule",
        "interleaved"], "--virtual 2 does not divide the 1 layers of a stage"),  # fmt: skip
    row("sequence-parallel-seq", [*GPT, "--mesh", "tensor=4", "--seq", "18",
        "--sequence-parallel"], "does not divide --seq 18; use a --seq that is a mul"),  # fmt: skip
    row("stage-layers-sum", [*GPT, "--mesh", "pipe=2", "--stage-layers", "1,2"],
        "--stage-layers 1,2 sums to 3 but the model has 4 layers"),  # fmt: skip
    row("stage-layers-count", [*GPT, "--mesh", "pipe=2", "--stage-layers", "1,1,2"],
        "--stage-layers 1,1,2 gives 3 stages but the mesh has pipe=2"),  # fmt: skip
    row("stage-layers-empty-stage", [*GPT, "--mesh", "pipe=2", "--stage-layers", "0,4"],
        "--stage-layers 0,4 has a stage without layers"),  # fmt: skip
    row("stage-layers-text", [*GPT, "--mesh", "pipe=2", "--stage-layers", "1;3"],
        "argument --stage-layers: needs comma-separated whole numbers"),  # fmt: skip
    row("stage-layers-no-pipe", [*GPT, "--stage-layers", "2,2"], "gives 2 stages but the mesh"),
    row("stage-layers-phased", [*GPT, "--mesh", "pipe=2", "--stage-layers", "1,3", "--phased"],
        "(leave out --stage-layers, or the phased settings)"),  # fmt: skip
    # Megatron-Core's split with the embedding or the loss counted as a layer
    row("split-not-dividing", [*GPT, *PIPE2, "--account-for-embedding-in-pipeline-split"],
        "4 layers and the embedding (--account-for-embedding-in-pipeline-split) make 5, which "
        "do not split evenly into pipe * virtual = 2 model chunks"),  # fmt: skip
    row("split-and-stage-layers", [*GPT, *PIPE2, "--stage-layers", "1,3",
        "--account-for-loss-in-pipeline-split"], "both set how layers are split"),  # fmt: skip
    row("split-phased", [*GPT, *PIPE2, "--phased", "--account-for-loss-in-pipeline-split"],
        "(leave out --account-for-loss-in-pipeline-split, or the phased settings)"),  # fmt: skip
    row("split-said", [*GPT, "--mesh", "pipe=3"], "or count the embedding and the loss as "
        "layers in the split (--account-for-embedding-in-pipeline-split and --account-for-"
        "loss-in-pipeline-split)"),  # fmt: skip
    row("split-no-pipe", [*GPT, "--account-for-embedding-in-pipeline-split"],
        "splits layers over pipeline stages, and pipe=1"),  # fmt: skip
    # phased settings
    row("phases-0", [*GPT, "--phased", "--phases", "0"], "phases must be a positive integer"),
    row("phases-3", [*GPT, "--phased", "--phases", "3"], "--phases 3 must divide the model's 4"),
    row("rts-0", [*GPT, "--phased", "--rts", "0"], "rts must be a positive integer, got 0"),
    row("rts-without-phased", [*GPT, "--rts", "2"], "--rts need --phased"),
    row("rts-optimizer-3", [*GPT, "--phased", "--mesh", "replica=4", "--rts-optimizer", "3"],
        "--rts-optimizer 3 must be 1, --rts (1) or the replica size (4)"),  # fmt: skip
    row("device-memory-0", [*GPT, "--phased", "--device-memory", "0"],
        "--device-memory must be a positive integer, got 0"),  # fmt: skip
    row("device-memory-negative", [*GPT, "--phased", "--device-memory", "-5"],
        "--device-memory must be a positive integer, got -5"),  # fmt: skip
    # run directories and checkpoints
    row("checkpoint-every-0", [*GPT, "--checkpoint-every", "0"],
        "--checkpoint-every must be a positive number of steps, got 0"),  # fmt: skip
    row("checkpoint-every-negative", [*GPT, "--checkpoint-every", "-1"],
        "--checkpoint-every must be a positive number of steps, got -1"),  # fmt: skip
    row("resume-missing", ["run", "--resume", "/nonexistent/run"], "cannot read"),
    # hardware
    row("hardware-unknown", [*GPT, "--hardware", "gpu-9000"], "unknown hardware 'gpu-9000'"),
    row("hardware-no-file", [*GPT, "--hardware", "/nonexistent/hw.toml"],
        "hardware profile: cannot read /nonexistent/hw.toml"),  # fmt: skip
    # plans
    row("plan-no-hardware", ["plan", "--model", "gpt-tiny"], "add --phased"),
    row("plan-hardware-unknown", [*PHASED, "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    # a phased plan's passes run 1F1B: another schedule is refused, not planned as 1F1B
    row("plan-phased-gpipe", [*PHASED, "--mesh", "pipe=2", "--schedule", "gpipe"],
        "--schedule gpipe plans a resident step"),  # fmt: skip
    # every microbatch size refused: the smallest's reason, of the most microbatches
    row("plan-microbatch-group-16", [*A100, "--mesh", "pipe=2", "--batch", "8", "--seq", "16",
        "--schedule", "interleaved", "--microbatch-group", "16"],
        "--microbatch-group 16 must lie between the 2 stages and the 8 microbatches"),  # fmt: skip
    row("run-phased-interleaved", [*GPT, "--mesh", "pipe=2", "--phased", "--schedule",
        "interleaved"], "phased execution runs the whole batch through each phase"),  # fmt: skip
    row("microbatch-group-short", [*GPT, "--mesh", "pipe=2", "--microbatches", "4",
        "--schedule", "interleaved", "--microbatch-group", "3"],
        "--microbatch-group 3 leaves a last group of 1"),  # fmt: skip
    # a flag that would change nothing on the mesh: refused, not dropped
    row("zero-one-replica", [*GPT, "--mesh", "tensor=2", "--zero", "2"],
        "--zero 2 shards over the devices that hold the same weights"),  # fmt: skip
    row("sequence-parallel-tensor-1", [*A100, "--mesh", "replica=2", "--sequence-parallel"],
        "--sequence-parallel splits over tensor, and pipe=1,tensor=1,replica=2 has"),  # fmt: skip
    row("scatter-gather-pipe-1", [*A100, "--mesh", "tensor=2", "--pipe-scatter-gather"],
        "--pipe-scatter-gather splits pipeline sends, and pipe=1,tensor=2"),  # fmt: skip
    row("scatter-gather-sequence-parallel", [*A100, "--mesh", "pipe=2,tensor=2",
        "--sequence-parallel", "--pipe-scatter-gather"], "its own share already"),  # fmt: skip
    row("pipe-sends-pipe-1", [*A100, "--pipe-sends", "blocking"],
        "--pipe-sends blocking times pipeline sends, and pipe=1,tensor=1"),  # fmt: skip
    row("bucket-mb-at-the-end", [*A100, "--mesh", "replica=2", "--grad-reduce", "end",
        "--bucket-mb", "10"], "--grad-reduce end reduces all the gradients at once"),  # fmt: skip
    row("phased-grad-reduce", [*PHASED, "--grad-reduce", "end"],
        "--grad-reduce is for resident plans: a phased plan reduces each phase's"),  # fmt: skip
    row("phased-grad-reduce-in-fp32", [*PHASED, "--grad-reduce-in-fp32"],
        "--grad-reduce-in-fp32 is for resident plans"),  # fmt: skip
    row("plan-rts-3", [*PHASED, "--mesh", "replica=4", "--rts", "3"],
        "--rts 3 does not divide replica=4"),  # fmt: skip
    row("plan-microbatch-0", [*A100, "--microbatch-size", "0"], "--microbatch-size 0 must be"),
    row("plan-microbatch-negative", [*A100, "--microbatch-size", "-1"], "--microbatch-size -1"),
    row("plan-microbatch-3", [*A100, "--microbatch-size", "3"], "divide the batch per replica"),
    row("plan-batch-0", [*A100, "--batch", "0"], "batch must be a positive integer, got 0"),
    row("plan-seq-huge", [*A100, "--seq", "100000"], "exceeds gpt-tiny's 128 positions"),
    row("plan-virtual-0", [*A100, "--mesh", "pipe=2", "--schedule", "interleaved", "--virtual",
        "0"], "virtual must be a positive integer, got 0"),  # fmt: skip
    row("plan-phased-pipe-3", [*PHASED, "--mesh", "pipe=3"], "4 layers do not split evenly"),
    row("plan-phased-stage-layers", [*PHASED, "--mesh", "pipe=2", "--stage-layers", "1,3"],
        "--stage-layers 1,3 is for resident plans"),  # fmt: skip
    row("plan-stage-layers-sum", [*A100, "--mesh", "pipe=2", "--stage-layers", "1,2"],
        "--stage-layers 1,2 sums to 3 but the model has 4 layers"),  # fmt: skip
    row("plan-phased-too-wide", [*PHASED, "--model", "gpt3-175b", "--mesh",
        "tensor=8,replica=512", "--batch", "512"], "tensor x replica = 4096 virtual devices"),
    row("demo-steps-0", ["demo", "--steps", "0"], "steps must be a positive integer, got 0"),
    # search
    row("search-precision", [*SEARCH, "--precision", "fp64"],
        "--precision takes a comma-separated"),
    row("search-sequence-parallel-tensor-1", [*SEARCH, "--max-tensor", "1",
        "--sequence-parallel"], "--max-tensor 1 leaves every layout tensor=1"),  # fmt: skip
    row("search-zero-stages", [*SEARCH, "--zero-stages", "1,5"],
        "--zero-stages takes a comma-separated list of 0, 1, 2 and 3, got '1,5'"),
    row("search-context-sizes", [*SEARCH, "--seq", "32", "--context-sizes", "2,3"],
        "--context-sizes takes a comma-separated list of positive integers that divide --seq 32"),
    row("bucket-mb-0", [*A100, "--bucket-mb", "0"], "--bucket-mb must be a finite number > 0, got"
        " 0"),
    row("bucket-mb-nan", [*SEARCH, "--bucket-mb", "nan"], "--bucket-mb must be a finite number > 0,"
        " got nan"),
    row("grad-reduce", [*A100, "--grad-reduce", "never"], "argument --grad-reduce: invalid choice"),
    row("attention-phased", [*PHASED, "--attention", "fused"], "--attention fused is for resident"),
    row("attention", [*SEARCH, "--attention", "flash"], "argument --attention: invalid choice"),
    row("search-precision-ipu", [*SEARCH[:4], "ipu-pod16", *SEARCH[5:], "--precision", "bf16"],
        "'ipu-pod16' does not compute in --precision bf16"),  # fmt: skip
    row("search-no-mesh", [*SEARCH[:6], "7"], "no mesh of 7 devices fits gpt-tiny"),
    row("search-devices-0", [*SEARCH[:6], "0"], "--devices and --max-tensor must be positive"),
    row("search-top-0", [*SEARCH, "--top", "0"], "--top must be a positive number of layouts"),
    row("search-modes", [*SEARCH, "--modes", "fast"], "argument --modes: invalid choice"),
    row("search-max-microbatch-0", [*SEARCH, "--max-microbatch", "0"],
        "--max-microbatch must be a positive integer, got 0"),  # fmt: skip
]  # fmt: skip


def one_clear_error(out, message):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("args", "message"), CLI_ROWS)
def test_bad_command_line_is_one_clear_error(args, message):
    one_clear_error(shardemu(*args), message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "holds a list; it must be a table (TOML) or an object (JSON)"),
        ('{"base": "a100-80gb", "peak_tflops": NaN}', "must be a finite positive number, got nan"),
        ('{"base": "a100-80gb", "peak_tflops": -1}', "must be a finite positive number, got -1"),
        ('{"base": "a100-80gb", "peak_tflops": "fast"}', "got 'fast'"),
        ('{"base": "a100-80gb", "devices_per_node": true}', "must be a positive integer, got True"),
        ('{"base": "a100-80gb", "efficiency": 1.5}', "efficiency must be in (0, 1]"),
        ('{"base": "a100-80gb", "name": 3}', "name must be a string, got 3"),
        ('{"base": "a100-80gb", "speed": 3}', "unknown key(s) speed"),
        ('{"base": "h900"}', "unknown base 'h900'"),
        ('{"base": "a100-80gb", "precisions": "bf16"}', "precisions must be a list such as"),
        ('{"base": "a100-80gb", "block_sparse_speed": 5}', "a list of [block, speed] pairs"),
        ('{"base": "a100-80gb", "host_memory_gb": 1e308}', "more memory than any machine"),
        ('{"peak_tflops": 100}', "is missing"),
        ("{", "does not parse"),
    ],
)
def test_bad_hardware_profile_is_one_clear_error(content, message, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(content)
    one_clear_error(shardemu(*GPT, "--hardware", str(path)), message)


def test_out_must_not_overwrite(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    one_clear_error(shardemu(*GPT, "--out", str(tmp_path / "file")), "is a file")
    one_clear_error(shardemu(*GPT, "--out", str(tmp_path / "full")), "is not empty")
    plan = [*A100, "--out", str(tmp_path / "full")]
    one_clear_error(shardemu(*plan), "already exists and is not empty")
    assert (tmp_path / "full" / "config.json").read_text() == "{}"  # nothing overwritten


def test_a_run_refused_before_its_first_step_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    one_clear_error(shardemu(*GPT, "--mesh", "tensor=3", "--out", str(out)), "not divisible")
    one_clear_error(shardemu(*GPT, "--mesh", "replica=2", "--batch", "7", "--out", str(out)), "7")
    assert not out.exists()


NAN = math.nan
API_ROWS = [
    (lambda: api.TrainConfig(learning_rate=NAN), "learning_rate must be a finite number > 0"),
    (lambda: api.TrainConfig(seed=-1), "seed must be an integer >= 0"),
    (lambda: api.TrainConfig(steps=True), "steps must be a positive integer, got True"),
    (lambda: api.TrainConfig(grad_clip=math.inf), "grad_clip must be a finite number > 0"),
    (lambda: api.TrainConfig(weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
    (lambda: api.TrainConfig(optimizer="sgd"), "optimizer must be one of adamw, lamb"),
    # a Python caller is told the field; the command line names its flag instead
    (lambda: api.TrainConfig(seed=2**33), "TrainConfig.seed 8589934592 is too large"),
    (lambda: api.TrainConfig(virtual=2), "TrainConfig.virtual 2 splits stages into chunks"),
    (lambda: api.PhasedConfig(rts=0), "PhasedConfig.rts must be a positive integer, got 0"),
    (
        lambda: api.plan(
            api.get_preset("gpt-tiny"),
            api.Parallelism(pipe=2),
            api.TrainConfig(account_for_loss_in_pipeline_split=True),
            phased=api.PhasedConfig(),
        ),
        "TrainConfig.account_for_loss_in_pipeline_split sets the layers of pipelined stages",
    ),
    (lambda: Overlap(bucket_mb=0), "Overlap.bucket_mb must be a finite number > 0, got 0"),
    (lambda: api.Parallelism(tensor=0), "tensor must be a positive integer"),
    (lambda: api.Parallelism(pipe=1.5), "pipe must be a positive integer, got 1.5"),
    (lambda: api.get_preset("gpt-tiny").replace(init_std=NAN), "init_std must be a finite"),
    (lambda: api.get_preset("gpt-tiny").replace(layer_norm_eps=0.0), "layer_norm_eps must be"),
    (lambda: api.Model(api.get_preset("gpt-tiny").replace(family="t5")), "family 't5'; regist"),
    (lambda: api.get_preset("gpt-tiny").replace(param_dtype="int8"), "param_dtype must be"),
    (lambda: api.get_preset("gpt-tiny").replace(num_heads=3), "not divisible by num_heads=3"),
    (lambda: api.get_preset("gpt-tiny").pad_vocab(0), "must be a positive integer, got 0"),
    (lambda: api.get_preset("nope"), "unknown model 'nope'"),
    (lambda: api.Parallelism.parse("tensor=2,pipe=x"), "needs an integer size, got 'x'"),
    (lambda: api.use_virtual_devices(0), "needs a positive device count, got 0"),
    (lambda: api.use_virtual_devices(4096), "more than the 2048"),
    (lambda: api.make_mesh(tensor=3), "needs 3 device(s)"),
    (lambda: get_hardware("tpu-v9"), "unknown hardware 'tpu-v9'"),
    (lambda: Hardware("x", NAN, 1, 1, 1, 1, 1, 1), "peak_tflops must be a finite positive"),
    (lambda: Hardware("x", 1, 1, 1, 1, 1, 1, 0), "devices_per_node must be a positive integer"),
    (lambda: Hardware("x", 1, 1, 1, 1, 1, 1, 1, efficiency=NAN), "efficiency must be in"),
    (lambda: api.resume_settings("/nonexistent"), "cannot read /nonexistent/config.json"),
    (lambda: get_hardware(None), "get_hardware takes a profile name"),
    (
        lambda: api.Trainer(
            api.Model(api.get_preset("gpt-tiny")),
            Mesh(jax.devices()[:1], ("data",)),
            api.TrainConfig(),
        ),
        "this one has 'data': rename them",
    ),  # fmt: skip
    (
        lambda: api.Model(api.get_preset("gpt-tiny")).batch(api.SyntheticCorpus(512), -5, 2, 8),
        "Model.batch: `step` must be an integer >= 0, got -5",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("call", "message"), API_ROWS)
def test_bad_python_call_is_a_shardemu_error(call, message):
    with pytest.raises(api.ShardemuError) as err:
        call()
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# --- hypothesis: a valid tiny command line, then one field broken (the valid ones run
# in test_checkpoint.py, beside the runs whose compiled step they share) ------------

VALID = {
    "--model": "gpt-tiny", "--steps": "1", "--batch": "4", "--seq": "8", "--seed": "0",
    "--mesh": "tensor=1", "--lr": "0.001",
}  # fmt: skip
BROKEN = {
    "--steps": ["0", "-3", "x", "1.5", "nan"],
    "--batch": ["0", "-4", "3x", "inf", str(10**40)],
    "--seq": ["0", "-8", "100000", "nan"],
    "--seed": ["-1", str(2**64), "zero", "1e3"],
    "--lr": ["0", "-1", "nan", "inf", "-inf", "1e999", "fast"],
    "--mesh": ["tensor=0", "tensor=3", "pipe=3", "replica=-1", "tensor", "tensor=2,tensor=2",
               "tensor=99999"],
    "--devices": ["0", "-1", "3", "9999", "x"],
    "--microbatches": ["0", "-2", "3"],
    "--grad-accum": ["0", "5", "x"],
    "--warmup": ["-1", "1.5"],
    "--pad-vocab": ["0", "-128", str(10**9)],
    "--checkpoint-every": ["0", "-1", "y"],
    "--virtual": ["0", "-1", "3"],
    "--hardware": ["gpu-9000", "/nonexistent.toml", "a.yaml"],
}  # fmt: skip


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(flag=st.sampled_from(sorted(BROKEN)), data=st.data())
def test_a_command_line_with_one_broken_field_is_refused(flag, data, tmp_path):
    """Each field here is broken so that no run is possible: it must be refused with
    one clear line, before anything compiles or is written."""
    value = data.draw(st.sampled_from(BROKEN[flag]), label=flag)
    args = {**VALID, flag: value, "--out": str(tmp_path / f"run{abs(hash((flag, value)))}")}
    out = shardemu("run", *[word for pair in args.items() for word in pair])
    assert out.returncode == 2, (flag, value, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (flag, value, out.stderr)
    assert not (tmp_path / f"run{abs(hash((flag, value)))}").exists()


def test_a_run_that_fails_before_its_first_step_removes_its_directory(tmp_path, monkeypatch):
    """The engine is built before the directory is made; a failure between the two
    (here, the compile) takes the directory away again."""
    from shardemu.run import engine

    def broken(self, seed):
        raise api.DeviceError("the compile failed")

    monkeypatch.setattr(engine.ResidentEngine, "init", broken)
    out = tmp_path / "run"
    one_clear_error(shardemu(*GPT, "--out", str(out)), "the compile failed")
    assert not out.exists()


def test_library_errors_name_fields_and_the_command_line_prints_flags():
    """No error raised outside `cli/` spells a flag: a Python caller is told the field
    (`TrainConfig.seed`) or keyword (`` `devices` ``) to fix, and the command line
    prints the flag its user typed in its place."""
    import ast
    import re
    from pathlib import Path

    from shardemu.cli.fields import flag_message

    package = Path(api.__file__).parent
    flag = re.compile(r"(?<![\w`-])--[a-z]")
    found = []
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                texts = [n.value for n in ast.walk(node.exc) if isinstance(n, ast.Constant)]
                if any(isinstance(t, str) and flag.search(t) for t in texts):
                    found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert found == []
    said = "TrainConfig.seed 9; `microbatch_size` 3; PhasedConfig.prefetch; Parallelism.tensor"
    assert flag_message(said) == "--seed 9; --microbatch-size 3; --no-prefetch; Parallelism.tensor"


def test_files_that_are_not_settings_are_one_clear_error(tmp_path):
    """Binary files given as settings, a sweep, a profile or a run to compare; a FIFO
    (which would block a read forever) and a device; a plan's directory to resume."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00steps = 3")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_bytes(b"\x00\xc3(")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    not_utf8 = "is not UTF-8 text (byte 0xff at offset 0)"
    one_clear_error(shardemu("run", "--config", str(binary)), f"--config: {binary} {not_utf8}")
    one_clear_error(shardemu("sweep", str(binary)), f"sweep file: {binary} {not_utf8}")
    profile = binary.with_suffix(".json")
    binary.rename(profile)
    one_clear_error(shardemu(*GPT, "--hardware", str(profile)), f"hardware profile: {profile}")
    one_clear_error(shardemu("compare", str(tmp_path / "run")), "is not UTF-8 text (byte 0xc3")
    one_clear_error(shardemu("run", "--config", str(fifo)), f"{fifo} is not a regular file")
    one_clear_error(shardemu("run", "--config", "/dev/zero"), "/dev/zero is not a regular file")
    plan = tmp_path / "plan"
    assert shardemu("plan", "--model", "gpt-tiny", "--hardware", "a100-80gb", "--out",
                    str(plan)).returncode == 0  # fmt: skip
    one_clear_error(shardemu("run", "--resume", str(plan)), "is a plan's config.json")
    # where a plot or a sweep cannot go: a name that is not a PNG, a folder that cannot be
    # made, a file where the sweep's directory should be
    compare = ["compare", str(plan), "--plot"]
    one_clear_error(shardemu(*compare, str(tmp_path / "p.json")), "the plot is a PNG")
    one_clear_error(shardemu(*compare, "/proc/none/p.png"), "/proc/none/p.png: cannot write it")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('metric = { name = "loss" }\n[parameters]\nseed = { values = [0] }\n')
    one_clear_error(shardemu("sweep", str(sweep), "--out", str(profile)), "is a file, not a")
    one_clear_error(shardemu("sweep", str(sweep), "--out", "/proc/none"), "cannot make the sweep")


def test_resuming_a_directory_that_is_not_there_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    train = api.TrainConfig(steps=1, batch=2, seq=8)
    with pytest.raises(api.CheckpointError, match="no run directory there"):
        api.train(api.get_preset("gpt-tiny"), api.Parallelism(), train, resume=missing,
                  devices=jax.devices()[:1])  # fmt: skip
    assert not missing.exists()


def test_a_plan_that_does_not_fit_exits_4_naming_the_tier_and_what_to_change(tmp_path):
    """gpt-tiny on a 1 MB device: the plan is written and printed, then one line says
    which tier, by how much and what would shrink it (not the settings already given; a
    higher ZeRO stage where there are replicas), exit status 4; --allow-overflow plans it
    with a warning and exit status 0. A smaller microbatch is suggested only where there
    is one (the size given, or the planner's choice, above 1)."""
    tiny = tmp_path / "tiny.json"
    tiny.write_text('{"base": "a100-80gb", "name": "a100-1mb", "device_memory_gb": 0.001}')
    plan = ["plan", "--model", "gpt-tiny", "--hardware", str(tiny), "--recompute", "full",
            "--microbatch-size", "2"]  # fmt: skip
    out = shardemu(*plan, "--json")
    assert out.returncode == 4, out.stderr
    assert json.loads(out.stdout)["memory_per_device"]["device"]["fits"] is False
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: gpt-tiny on pipe=1,tensor=1,replica=1 does not fit a100-1mb")
    assert "its device tier holds" in line
    assert "GB over the 0.00085 GB it has (less the 15% its allocator fragments)" in line
    assert "--recompute full" not in line and "--allow-overflow" in line
    assert "a smaller --microbatch-size" in line and "--zero" not in line  # one replica
    replicas = shardemu(*plan, "--mesh", "replica=2", "--zero", "2", "--json")
    assert replicas.returncode == 4 and ", --zero 3 (ZeRO: the optimizer" in replicas.stderr
    anyway = shardemu(*plan, "--json", "--allow-overflow")
    assert anyway.returncode == 0 and anyway.stderr.startswith("warning: gpt-tiny"), anyway.stderr
    # not given, the size chosen is already the smallest: no smaller one is suggested
    chosen = shardemu(*plan[:-2], "--json")
    assert chosen.returncode == 4 and json.loads(chosen.stdout)["microbatch_size"] == 1
    assert "--microbatch-size" not in chosen.stderr.strip().splitlines()[-1], chosen.stderr


def test_a_phased_plan_that_does_not_fit_suggests_only_what_can_shrink_it(tmp_path):
    """Phased, on a 1 MB device: more phases only where a phase holds more than one
    layer, a larger rts only below the replicas, offloading unless given, and more
    devices always."""
    tiny = tmp_path / "tiny.json"
    tiny.write_text('{"base": "a100-80gb", "name": "a100-1mb", "device_memory_gb": 0.001}')
    plan = ["plan", "--model", "gpt-tiny", "--hardware", str(tiny), "--phased"]
    alone = shardemu(*plan)  # a layer a phase (the planner's choice), one replica
    assert alone.returncode == 4, alone.stderr
    said = alone.stderr.strip().splitlines()[-1]
    assert "phases" not in said and "--rts" not in said.split("with --rts")[0]
    assert "--activations offload" in said and "more devices in --mesh" in said
    shared = shardemu(*plan, "--phases", "2", "--mesh", "replica=2", "--activations", "offload")
    said = shared.stderr.strip().splitlines()[-1]
    assert "more --phases" in said and "a larger --rts" in said
    assert "--activations offload" not in said


def test_a_batch_the_step_cannot_take_is_refused_before_it_compiles():
    """A key missing, a shape for other settings, token ids past the vocabulary (which
    read no embedding row: a NaN loss before): one ConfigError each from a Trainer's
    step, checked on the host before anything compiles (the pipelined and phased steps
    call the same `Model.check_batch`)."""
    model = api.Model(api.get_preset("gpt-tiny"))
    train = api.TrainConfig(batch=4, seq=8)
    trainer = api.Trainer(model, api.make_mesh(devices=jax.devices()[:1]), train)
    good = model.batch(api.SyntheticCorpus(512), 0, 4, 8)
    bad = [
        ({"tokens": good["tokens"]}, "batch holds targets, tokens; got tokens"),
        ({k: v[:2] for k, v in good.items()}, "has shape (2, 8); the step takes (4, 8)"),
        ({**good, "tokens": good["tokens"] + 512}, "outside gpt-tiny's vocabulary of 512"),
    ]
    for batch, message in bad:
        with pytest.raises(api.ConfigError, match=re.escape(message)):
            trainer.step(None, None, batch)
        with pytest.raises(api.ConfigError, match=re.escape(message)):
            model.check_batch(batch, 4, 8)
