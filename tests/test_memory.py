"""Measured peak memory of memsave against tf.gradients, and the memory model's
predictions against those measurements (issues 3 and 9).

Every configuration runs in its own process with the CPU BFC allocator on
(memsave.measure.run_isolated), so peaks never mix. These children see memsave's
default behaviour (no MEMSAVE_ALWAYS_REWRITE): what a user gets.
"""

import functools
import math
import os
import tempfile

import pytest

from memsave.graph import _tf_private
from memsave.measure import memory_limit_env, run_isolated, xla_buffer_bytes, xla_dump_env

from _shared_runs import once_per_run
from _versions import XLA_SAVINGS_MEASURED

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PREDICTION_TOLERANCE = 0.15

pytestmark = [pytest.mark.planner_fallback, pytest.mark.measures]


@functools.lru_cache(maxsize=None)
def _measure(case, mode, **kwargs):
    return once_per_run(repr((case, mode, sorted(kwargs.items()))),
                        lambda: _run_case(case, mode, **kwargs))


def _run_case(case, mode, **kwargs):
    env = {"PYTHONPATH": TESTS_DIR}
    if not kwargs.get("jit"):
        return run_isolated(f"_memory_cases:{case}", env=env, mode=mode, **kwargs)
    # Under XLA the same process dumps XLA's buffer assignment: one process for both.
    with tempfile.TemporaryDirectory() as dump:
        got = run_isolated(f"_memory_cases:{case}", env=dict(xla_dump_env(dump), **env),
                           mode=mode, **kwargs)
        got["xla_buffer_mb"] = xla_buffer_bytes(dump) / 2**20
    return got


def measure(case, **kwargs):
    """The case's measured peak, its prediction and its gradients' checksum, each
    configuration measured once per test run (across pytest-xdist's workers too) in a
    process of its own (`jit=True`: also XLA's buffers, "xla_buffer_mb")."""
    mode = kwargs.pop("mode")
    if kwargs.get("jit") is False:
        del kwargs["jit"]  # (the default: the same configuration, the same process)
    return _measure(case, mode, **kwargs)


def _assert_predicted(got, what, over=PREDICTION_TOLERANCE, under=PREDICTION_TOLERANCE):
    """The prediction is within `under` below the measured peak and within `over`
    above it."""
    error = got["predicted_mb"] / got["peak_mb"] - 1
    assert -under <= error <= over, (
        f"{what}: predicted {got['predicted_mb']:.1f} MiB, measured {got['peak_mb']:.1f} MiB "
        f"({error:+.0%})")


@pytest.mark.parametrize("mode", ["memory", "listed"])
def test_chain_of_100_tanh_peaks_at_most_a_quarter(mode):
    baseline = measure("chain", mode="tf")
    got = measure("chain", mode=mode)
    ratio = got["peak_mb"] / baseline["peak_mb"]
    assert baseline["peak_mb"] > 90, baseline  # 100 x 1 MB activations
    assert ratio <= 0.25, f"{mode}: {got['peak_mb']:.1f} MiB vs {baseline['peak_mb']:.1f} MiB"
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)


def test_resnet_like_chain_of_100_blocks_peaks_at_most_30_percent():
    baseline = measure("chain", mode="tf", residual=True)
    got = measure("chain", mode="memory", residual=True)
    ratio = got["peak_mb"] / baseline["peak_mb"]
    assert ratio <= 0.30, f"{got['peak_mb']:.1f} MiB vs {baseline['peak_mb']:.1f} MiB"
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)


def test_deep_mlp_peaks_at_most_half():
    # (Under XLA, where XLA must not merge the recomputation back into the forward pass,
    # test_under_xla_memory_keeps_its_ratio_in_xlas_buffers measures an MLP and a CNN.)
    baseline = measure("deep_mlp", mode="tf")
    got = measure("deep_mlp", mode="memory")
    ratio = got["peak_mb"] / baseline["peak_mb"]
    assert ratio <= 0.50, f"{got['peak_mb']:.1f} MiB vs {baseline['peak_mb']:.1f} MiB"
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-4)


def test_small_cnn_under_xla_saves_as_much_as_without():
    # XLA adds about 10 MB to both steps of this small CNN (measured: 54.1 -> 64.6 MB and
    # 22.5 -> 32.6 MB), so the saving in MB is what must survive, not the ratio.
    saved = {}
    for jit in (False, True):
        baseline = measure("small_cnn", mode="tf", jit=jit)
        got = measure("small_cnn", mode="memory", jit=jit)
        saved[jit] = baseline["peak_mb"] - got["peak_mb"]
        assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-4)
    assert saved[True] >= 0.9 * saved[False] > 0, saved


@XLA_SAVINGS_MEASURED
@pytest.mark.parametrize("case", ["small_cnn", "layer_norm_mlp"])
def test_under_xla_memory_keeps_its_ratio_in_xlas_buffers(case):
    """By XLA's buffer assignment of the step under XLA, 'memory' must save within 0.05 of
    what it saves without XLA. Each checkpoint a segment reads, and each gradient it
    passes on, goes through a conditional XLA must materialise; without that, XLA fused
    their elementwise producers into the readers and kept the producers' inputs alive:
    the CNN's checkpoints (0.54 against 0.41 without XLA), the layer-norm MLP's gradients
    (0.50 against 0.36)."""
    buffers = {mode: measure(case, mode=mode, jit=True)["xla_buffer_mb"]
               for mode in ("tf", "memory")}
    under_xla = buffers["memory"] / buffers["tf"]
    without = measure(case, mode="memory")["peak_mb"] / measure(case, mode="tf")["peak_mb"]
    assert under_xla <= without + 0.05, (under_xla, without, buffers)


@XLA_SAVINGS_MEASURED
def test_under_xla_memory_runs_in_xlas_buffers_where_tf_gradients_does_not():
    """XLA's buffers are what the allocator needs: the step runs under a cap a little above
    them (the cap held as one region, as a GPU's allocator holds its memory), where
    tf.gradients' step cannot: its buffer assignment alone is larger than the cap.
    (Uncapped, the allocator's peak also counts free chunks it did not split for XLA's
    one large buffer: 32.6 MB for the CNN's 25.0.) tf.gradients is not run under the cap:
    a run that does not fit waits 10 s for memory before it fails."""
    case = "small_cnn"
    cap_mb = math.ceil(measure(case, mode="memory", jit=True)["xla_buffer_mb"] * 1.05 + 2)
    assert measure(case, mode="tf", jit=True)["xla_buffer_mb"] > cap_mb, (
        f"tf.gradients' XLA buffers fit in {cap_mb} MiB: nothing to show")
    capped = run_isolated("_memory_cases:capped", case=case, limit_mb=cap_mb, mode="memory",
                          jit=True, env=dict(memory_limit_env(cap_mb), PYTHONPATH=TESTS_DIR))
    assert not capped.get("oom"), f"'memory' under XLA does not run in {cap_mb} MiB"


LSTM_STACK = dict(batch=64, steps=64, units=256, features=32)


def test_an_lstm_stack_differentiated_through_recomputing_copies():
    """2 x Keras LSTM(256) over 64 steps: TensorFlow keeps every step's gates for the
    gradient (74.0-74.9 MiB, AMD EPYC without AVX-512, TensorFlow 2.16 and 2.21);
    memsave's recomputing copies keep each step's carry, one loop at a time (23.5-23.9
    MiB, 25.6 predicted), predicted within 15%: each carry and each TensorList element
    is an allocation of its own, which BFC places in whatever hole fits (at 100 steps,
    as one 19 MiB buffer, the replay put the carries in a region of their own: 36.1 MiB
    predicted for 28.4-31.8), the copy reads the TensorList the loop read (the first
    LSTM's sequence, 4 MiB, kept to the second's gradient), and a reserved TensorList
    holds nothing until the loop writes it. tf.gradients' own peak depends on how far
    the executor runs the gradient loop ahead, up to 32 iterations in some processes,
    none in others (at 100 steps, 110-113 MiB against 137-151): it lies within 15% of
    the range the model gives, from none to all of them (the report's
    baseline_peak_range). (100 steps took 7 s more of the suite's time and said the
    same.) memsave's copies run their loops' gradients, so its plan has no range."""
    baseline = measure("lstm_stack", mode="tf", **LSTM_STACK)
    got = measure("lstm_stack", mode="memory", **LSTM_STACK)
    ratio = got["peak_mb"] / baseline["peak_mb"]
    assert ratio <= 0.40, f"{got['peak_mb']:.1f} MiB vs {baseline['peak_mb']:.1f} MiB"
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)
    error = got["predicted_mb"] / got["peak_mb"] - 1
    assert -0.15 <= error <= 0.15, (got, error)
    assert got["predicted_range_mb"] is None, got
    least, most = baseline["predicted_range_mb"]
    assert least < baseline["predicted_mb"] < most, baseline
    assert (least * (1 - PREDICTION_TOLERANCE) <= baseline["peak_mb"]
            <= most * (1 + PREDICTION_TOLERANCE)), baseline


@pytest.mark.parametrize("mode", ["tf", "memory"])
def test_the_hidden_buffer_of_an_xla_grouped_convolution_gradient_is_predicted(mode):
    """Keras runs a grouped convolution on a CPU as an XLA-compiled function; the program
    of its gradient holds two dense filters (24.5 MiB at 256 channels, 7x7) that no
    tensor of the graph shows: 34 MiB measured (AMD EPYC), 9 predicted without them
    (memsave.planner.xla_buffers), 34.5 with."""
    got = measure("grouped_conv_stack", mode=mode)
    _assert_predicted(got, f"grouped_conv_stack with {mode}")


@pytest.mark.parametrize("case", ["chain", "chain_v1", "deep_mlp", "small_cnn"])
@pytest.mark.parametrize("mode", ["tf", "memory"])
def test_predicted_peak_is_within_15_percent_of_the_measured_one(case, mode):
    got = measure(case, mode=mode)
    _assert_predicted(got, f"{case} with {mode}")


# How far over the measured peak a prediction may be, where not PREDICTION_TOLERANCE:
# steps whose measured peak moves with where BFC places a few chunks (2 MiB for 1,
# unsplit), 25%; a step whose small gradient ops 'memory' leaves unordered (under 3% of
# its predicted peak), which the executor runs in an order holding less than the
# model's, 30%.
_OVER_ALLOWED = {("bfloat16_cnn", "memory"): 0.25, ("nested_calls", "memory"): 0.25,
                 ("scaled_attention", "memory"): 0.30}


@pytest.mark.parametrize("case", ["keras_gpt", "scaled_attention", "nested_calls",
                                  "bfloat16_cnn", "gelu_mlp"])
@pytest.mark.parametrize("mode", ["tf", "memory"])
def test_the_prediction_holds_on_each_model_family(case, mode):
    """Attention and embeddings (a small Keras GPT: its head's BiasAdd and cross-entropy
    write into their inputs' buffers), attention written by hand (the softmax products
    Grappler moves into the forward pass: 39.5 / 37.0 MiB for tf.gradients, 12.3-12.8 /
    13.4 for 'memory'; 25.0 and 9.6 predicted without them), nested tf.function calls
    (what their gradients keep of their runs), mixed bfloat16 (Keras' policy), the tanh
    approximation of GELU (its `pow(x, 3)`: 153.0 / 179.0 MiB for tf.gradients, +17%, while
    the model held the power for its gradient; 151.0 since, and 71.0 / 75.0 for
    'memory'). AMD EPYC without AVX-512: GPT
    40.9 / 38.9 MiB measured / predicted for tf.gradients (+27% before BiasAdd's buffer
    was known), 24.0 / 25.4 for 'memory'; the nested calls 110.2 / 114.0 (64.0, -42%,
    before their kept intermediates were), 40.2 / 41.0; bfloat16 70.2 / 75.5,
    38.5 / 38.5. AMD EPYC with AVX-512 (oneDNN on): bfloat16 49.0 / 46.0 for
    tf.gradients, 19.1-21.0 / 21.0 for 'memory' (at 6 blocks of batch 16, 8.1-9.0 /
    9.0, and 6.5 in a process in four, +38%, while the inputs were made by
    tf.constant, which sometimes keeps its copy of an array outside the allocator:
    memsave.measure.device_input). Intel Xeon with AVX-512 and AMX: bfloat16 'memory'
    19.95 / 22.0 while its last segment was recomputed, 18.95 / 22.0 since it reads the
    forward pass's tensors (+16%): the model holds the same 18.1 MiB of tensors either
    way, and its allocator replay serves four 1-MiB activations from chunks of almost
    2 MiB, which BFC does not split (3.9 MiB, where the measured step holds 0.8 more than
    its tensors). The nested calls' 'memory' step holds 38.25 MiB of tensors, and the
    replay places its 2-MiB activations as one order of allocations would, 45.0 MiB
    (Intel Xeon's, 42.25-43.25 measured, +4% to +7%); CI's machine once measured 38.75
    (+16%), the executor's order leaving no chunk unsplit. CI's run of 2026-11-30 (AMD
    EPYC with AVX-512, TensorFlow 2.21, two workers) measured the bfloat16 'memory' step
    at 18.0 MiB, below its 18.1 MiB of tensors, for 22.0 predicted (+22%; 19.1-21.0 in
    single runs on that CPU). Where placement decides the peak, 25% over is allowed.
    Since 'memory' orders only gradient ops holding 3% of its predicted peak (the hand-
    written attention's 2-MiB scores, not its 256-KiB activations), the executor runs the
    rest in an order that holds less than the model's, tf.gradients': 10.7-10.8 MiB for
    13.3 predicted (+23% to +24%; 12.3-12.8 while every op was ordered; AMD EPYC with
    AVX-512, family 26): 30% over is allowed there, and 15% under, as everywhere."""
    got = measure(case, mode=mode)
    _assert_predicted(got, f"{case} with {mode}",
                      over=_OVER_ALLOWED.get((case, mode), PREDICTION_TOLERANCE))


def test_a_budget_on_a_language_model_is_predicted():
    """A budget may keep the head's logits (its MatMul's output and the BiasAdd written
    into it) where its last segment, the loss, reads the forward pass: no copy reads
    them again, so the BiasAdd and the loss's backprop still write into the logits'
    buffer, as under tf.gradients (Intel Xeon with AVX-512: the plan keeps both, 30.55
    MiB measured, 28.76 predicted; while the model gave each its own buffer, the budget
    recomputed the head instead: 23.5 MiB at a 'memory'-like plan). Within 15%, and the
    same gradients (their sum, float32)."""
    baseline = measure("keras_gpt", mode="tf")
    got = measure("keras_gpt", mode="budget:0.8")
    assert got["rewritten"] and got["checkpoints"] > 0
    _assert_predicted(got, "keras_gpt with budget(0.8)")
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-4)


def test_nested_calls_are_recomputed_and_the_step_holds_less():
    """24 calls of a nested tf.function: a segment's copies wait for the gradient the
    next segment's backward call makes (through its outputs: TensorFlow inlines the
    call, and a control edge from it would wait for its stateful ops only, so every
    copy ran in the forward pass, 110.2 MiB as tf.gradients', before)."""
    baseline = measure("nested_calls", mode="tf")
    got = measure("nested_calls", mode="memory")
    assert got["peak_mb"] <= 0.5 * baseline["peak_mb"], (got, baseline)
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)


@pytest.mark.parametrize("mode", ["tf", "memory"])
def test_predicted_peak_of_a_silu_mlp_is_never_far_below_the_measured_one(mode):
    """A custom gradient (SiLU) is built once to see what it holds: the prediction may
    not fall more than 15% below the measured peak, nor lie more than 25% above it. The
    'memory' step measured 44.8 MB on an Intel Xeon and 36.8-40.0 MB on AMD EPYCs with
    AVX-512 against 46.0 predicted (+3%, +15% to +25%); SiLU's gradient holds one tensor
    besides its result (it writes the result into its sigmoid's or `1 - sigmoid`'s
    buffer) and each is an allocation of its own: 44.0 predicted (+10% to +20% on the
    EPYCs). The rest is the gradient of `h * h` and its sum, which TensorFlow writes into
    buffers it frees (issue 29). (Before the model built custom gradients it predicted
    tf.gradients' step at +47%.)"""
    got = measure("silu_mlp", mode=mode)
    _assert_predicted(got, f"silu_mlp with {mode}", over=0.25)


def test_weight_gradients_made_last_lower_the_measured_peak_as_predicted():
    # The head's three 1024x1024 weight gradients (12 MB) are made by the time the
    # trunk's backward pass runs; made after it instead, they are not held through it.
    baseline = measure("trunk_and_wide_head", mode="tf")
    deferred = measure("trunk_and_wide_head", mode="memory")
    made_at_once = measure("trunk_and_wide_head", mode="memory", defer=False)
    head_gradients_mb = 3 * 4
    assert deferred["peak_mb"] <= made_at_once["peak_mb"] - 0.6 * head_gradients_mb, (
        deferred, made_at_once)
    for got, what in ((deferred, "made last"), (made_at_once, "made at once")):
        _assert_predicted(got, f"trunk and wide head, weight gradients {what}")
        assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)
    # tf.gradients' own step is left to the executor: in some processes (1 in 6 on
    # TensorFlow 2.16, AMD EPYC without AVX-512) it runs two of the trunk's filter
    # gradients side by side, each with its 27 MiB im2col buffer (96.2 and 100.2 MiB
    # measured against 68.9-71.0 in the others; predicted 68.2). The rewrite runs them
    # one after the other. The prediction holds, or the step held one buffer more.
    im2col_mb = 27
    highest = baseline["predicted_mb"] * (1 + PREDICTION_TOLERANCE)
    if baseline["peak_mb"] > highest:
        assert baseline["peak_mb"] <= highest + im2col_mb, baseline
    else:
        _assert_predicted(baseline, "trunk and wide head, tf.gradients")


def test_mixed_precision_weight_gradients_made_last_are_predicted_and_never_chosen_to_cost():
    """Eight 3x3 convolutions of 256 channels at 8x8 pixels under mixed_bfloat16: large
    float32 weights read through Casts, small activations. The rewrite makes a Cast
    weight's gradient last with the filter gradient that makes it, and an executor with
    two threads runs those side by side, with their im2col buffers where TensorFlow's
    own kernels run (oneDNN off). Where the model knew neither, 'memory' rewrote this
    step to 54.4-55.0 MiB, predicted 41.9, above tf.gradients' 43.5-54.3 (AMD EPYC
    without AVX-512). Now it predicts the rewrite there (52.1) above tf.gradients' 47.0,
    so plain tf.gradients runs; forced, the rewrite is measured at its prediction.
    tf.gradients' own peak here moves from process to process with the order the two
    threads run its filter gradients in (44.6-57.2 MiB in 13 processes, same CPU, 47.0
    predicted): its prediction is held within that spread, 20% (one process; the
    median of three took 22 s more of CI's 15 minutes). Whether 'memory' rewrites the
    step is asked of memsave.plan in tf.gradients' process: a run of its own took 9 s."""
    options = dict(blocks=8, batch=4, size=8, channels=256)
    baseline = measure("bfloat16_cnn", mode="tf+decide:memory", **options)
    forced = run_isolated("_memory_cases:bfloat16_cnn", mode="memory", **options, env={
        "PYTHONPATH": TESTS_DIR, "MEMSAVE_ALWAYS_REWRITE": "1"})
    assert forced["rewritten"], forced
    _assert_predicted(forced, "bfloat16 convolutions of large weights, rewritten")
    _assert_predicted(baseline, "bfloat16 convolutions of large weights with tf.gradients",
                      under=0.2)
    if not _tf_private.onednn_enabled():  # (the im2col buffers: the rewrite costs)
        assert baseline["decided"] is False, baseline
    elif baseline["decided"]:  # (the rewrite, where chosen, peaks no higher)
        assert forced["peak_mb"] <= 1.05 * baseline["peak_mb"], (forced, baseline)
    assert forced["checksum"] == pytest.approx(baseline["checksum"], rel=1e-2)


@XLA_SAVINGS_MEASURED
def test_under_xla_weight_gradients_made_last_lower_xlas_buffers(tmp_path):
    # XLA drops control inputs: the deferred gradients read their inputs through a
    # conditional on the last segment's gradients instead. Measured: 40.5 MB of XLA
    # buffers made last, 46.1 MB made at once (tf.gradients 54.1 MB).
    buffers, checksums = {}, {}
    for defer in (True, False):
        dump = tmp_path / f"defer_{defer}"
        got = run_isolated("_memory_cases:trunk_and_wide_head", mode="memory", defer=defer,
                           jit=True, env=dict(xla_dump_env(str(dump)), PYTHONPATH=TESTS_DIR))
        buffers[defer] = xla_buffer_bytes(str(dump)) / 2**20
        checksums[defer] = got["checksum"]
    assert buffers[True] <= buffers[False] - 0.3 * 3 * 4, buffers
    assert checksums[True] == pytest.approx(checksums[False], rel=1e-5)


def test_budgets_are_kept_and_smaller_budgets_never_peak_higher():
    baseline = measure("chain", mode="tf")
    previous = None
    for fraction in (0.6, 0.4, 0.25):
        got = measure("chain", mode=f"budget:{fraction}")
        limit_mb = fraction * baseline["predicted_mb"]
        assert got["peak_mb"] <= 1.10 * limit_mb, (fraction, got, limit_mb)
        assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)
        if previous is not None:
            assert got["peak_mb"] <= 1.03 * previous["peak_mb"], (fraction, got, previous)
        previous = got
