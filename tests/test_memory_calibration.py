"""memsave.calibrate_memory: one measured run of tf.gradients' step, and budgets that
plan with it (memsave.planner.calibrated) (issue 29).

The measured cases run in their own process with the CPU BFC allocator on
(_calibration_cases, memsave.measure.run_isolated): each gradient is compared with
tf.gradients' in float64.
"""

import functools
import os

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.measure import run_isolated
from memsave.planner.calibrated import Allocation, Calibrated, MemoryCalibration
from memsave.rewrite import answered_by_tf_gradients

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PREDICTION_TOLERANCE = 0.15
MIB = 2 ** 20

pytestmark = pytest.mark.planner_fallback


@functools.lru_cache(maxsize=None)
def _measure(case, **kwargs):
    return run_isolated(f"_calibration_cases:{case}", env={"PYTHONPATH": TESTS_DIR}, **kwargs)


@pytest.mark.measures
def test_a_calibrated_byte_budget_counts_the_batch_a_placeholder_leaves_unknown():
    # The model counts a [None, 256] placeholder's batch as 1: 70% of tf.gradients'
    # measured peak looks like room for the whole step, and plain tf.gradients runs
    # far over it. The calibration measured the batch (2048) and the plan fits.
    plain = _measure("v1_unknown_batch", calibrated=False, fraction=0.7)
    assert plain["fallback"] is not None and "fits the budget" in plain["fallback"]
    assert plain["peak_mb"] > (1 + PREDICTION_TOLERANCE) * plain["limit_mb"]

    got = _measure("v1_unknown_batch", calibrated=True, fraction=0.7)
    assert got["error"] <= 1e-12
    assert got["fallback"] is None and got["checkpoints"] > 0
    assert got["unknown_dim_size"] == 2048
    assert got["memory_calibration"].startswith("tf.gradients' step measured at")
    assert got["measured_baseline_mb"] == got["calibration_mb"]
    # (The median of 25 steps. Each segment's recomputation waits for the last built
    # segment's whole backward pass, as the model has it; waiting for the gradient it
    # reads alone, this plan's steps measured 59.0-67.5 MiB, median 63.0, for 54.5
    # predicted, and 46.5-63.5, median 50-55.5, with it: AMD EPYC without AVX-512,
    # TensorFlow 2.16 and 2.21.)
    assert got["peak_mb"] <= 1.10 * got["limit_mb"], got
    assert abs(got["calibrated_mb"] / got["peak_mb"] - 1) <= PREDICTION_TOLERANCE, got
    assert any(name.startswith("MatMul") for name in got["largest_at_peak"])
    assert "calibrated:" in got["summary"] and "as measured" in got["summary"]


@pytest.mark.measures
def test_a_tf_function_is_calibrated_in_a_fresh_trace_and_then_planned_with_it():
    """The plan's peak is not held to the limit here: as a tf.function this MLP's plans
    measure above their prediction by amounts that change from run to run (the allocator
    rounds two 4 MiB tensors up to 8 MiB chunks, and the executor runs the next segment's
    recomputation ahead by varying amounts), which a calibration of tf.gradients' step
    does not correct. AMD EPYC with AVX-512, 90.5-91.0 MiB measured for tf.gradients:
    budget(0.7)'s plans 68.5-84.5 MiB for 62 predicted (0.75-0.93 of it; TensorFlow
    2.16, the highest, failed the 0.9 this test held it to), budget(0.6)'s 55.0-60.5 for
    54 (0.61-0.67, on 2.16 and 2.21)."""
    got = _measure("function_step", fraction=0.6)
    assert got["traces_after_calibration"] == 0  # (the step's own traces left alone)
    assert got["error"] <= 1e-12
    assert got["fallback"] is None and got["memory_calibration"] is not None
    assert got["measured_baseline_mb"] == got["calibration_mb"]
    assert got["calibrated_mb"] <= got["limit_mb"]
    assert got["peak_mb"] < 0.8 * got["calibration_mb"], got


@pytest.mark.measures
def test_a_memsave_call_in_a_nested_tf_function_is_refused_not_left_answered_plainly():
    got = _measure("nested_function_step")
    assert "not in the step's own trace" in got["error"]
    assert got["inner_traces"] == 0  # (a failed trace is not kept)


def test_calibrating_while_a_function_is_traced_is_refused():
    @tf.function
    def outer():
        memsave.calibrate_memory(lambda: None)
        return 0

    # (AutoGraph passes a MemsaveError raised in converted code on as a StagingError.)
    with pytest.raises(Exception, match="memsave: calibrate_memory runs the step; call it "
                                        "eagerly"):
        outer()


def test_allocations_whose_records_the_profiler_dropped_are_skipped():
    from memsave.calibration import _records

    def made(op, nbytes):
        return {"activityMetadata": {"tfOpName": op, "allocationBytes": str(nbytes),
                                     "regionType": "output", "tensorShape": "[4]"}}

    profile = {"memoryProfilePerAllocator": {"cpu": {
        "profileSummary": {"peakStats": {"peakBytesInUse": "300"}},
        "memoryProfileSnapshots": [made("a", 100), made("b", 200)],
        "specialAllocations": [{"tfOpName": "", "allocationBytes": "50"}],
        "activeAllocations": [{"snapshotIndex": "1", "specialIndex": "-1"},
                              {"snapshotIndex": "-1", "specialIndex": "0"},
                              {"snapshotIndex": "-1", "specialIndex": "-1"},
                              {"snapshotIndex": "7", "specialIndex": "-1"}]}}}
    at_peak, ops, shapes = _records(profile, 300)
    assert [(a.op, a.bytes) for a in at_peak] == [("b", 200), ("", 50)]
    assert ops == {"a", "b"} and dict(shapes) == {"a": "[4]", "b": "[4]"}
    assert _records(None, 300) == ((), frozenset(), ())


def _calibration(peak, before, **kwargs):
    return MemoryCalibration(peak_bytes=peak * MIB, before_bytes=before * MIB, device="CPU:0",
                             **kwargs)


def test_the_model_is_scaled_up_where_it_misses_below_and_left_alone_where_above():
    # Model: 10 MiB resident, tf.gradients' step 100 MiB. Measured: 12 MiB before the
    # step (2 the graph does not hold), 212 at the peak: the step's own 200, twice the
    # model's 100.
    under = Calibrated(_calibration(212, 12), 110 * MIB, 10 * MIB)
    assert under.extra == 2 * MIB and under.scale == pytest.approx(2.0)
    assert under.measured(110 * MIB) == 212 * MIB
    assert under.measured(60 * MIB) == 112 * MIB
    assert under.model(under.measured(73 * MIB)) == pytest.approx(73 * MIB, abs=1)
    assert "scaled by 2.00" in under.describe()
    assert "2.0 MiB in use before it not in the graph" in under.describe()
    over = Calibrated(_calibration(80, 10), 110 * MIB, 10 * MIB)
    assert over.scale == 1.0 and over.measured(60 * MIB) == 60 * MIB
    assert "as they are" in over.describe()


def test_buffers_no_op_made_are_added_to_every_prediction_not_scaled():
    # An XLA program's temporary (no op name) of 50 MiB at the measured peak: the rest of
    # the step (100 MiB) is what the model predicted, so nothing is scaled, and each
    # plan's prediction grows by 50 MiB.
    calibration = _calibration(160, 10, at_peak=(Allocation("", "", 50 * MIB),
                                                 Allocation("MatMul", "output", 30 * MIB)))
    assert calibration.unattributed_bytes == 50 * MIB
    assert "50.0 MiB at the peak made by no op" in str(calibration)
    calibrated = Calibrated(calibration, 110 * MIB, 10 * MIB)
    assert calibrated.scale == 1.0 and calibrated.unattributed == 50 * MIB
    assert calibrated.measured(110 * MIB) == 160 * MIB
    assert calibrated.measured(40 * MIB) == 90 * MIB
    assert calibrated.model(90 * MIB) == 40 * MIB
    assert "50.0 MiB no op made" in calibrated.describe()
    # A model that counts them already (memsave.planner.xla_buffers) gets none added.
    counted = Calibrated(calibration, 160 * MIB, 10 * MIB)
    assert counted.unattributed == 0 and counted.scale == 1.0
    assert counted.measured(110 * MIB) == 110 * MIB
    assert "no op made" not in counted.describe()


def test_the_calibration_gives_the_unknown_dimensions_the_measured_size():
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        tf.matmul(x, tf.ones([4, 8]), name="product")
        tf.reduce_sum(x, name="total")
    calibration = _calibration(1, 0, shapes=(("product", "[32,8]"), ("total", "[]"),
                                             ("elsewhere", "[7,8]"), ("x", "unknown")))
    assert calibration.unknown_dim_size(graph) == 32
    assert _calibration(1, 0, shapes=(("total", "[]"),)).unknown_dim_size(graph) is None


def test_a_calibration_of_another_step_is_refused_naming_an_op():
    with tf.Graph().as_default() as graph:
        tf.constant(1.0, name="a")
        tf.constant(2.0, name="b")
    mine = _calibration(1, 0, ops=frozenset(["a", "b", "gradients/a_grad/Mul"]))
    mine.check_measures(graph)
    # (The profiler names an op inside a loop's body, or a call's function, after the
    # loop: 'a/body/_1/a/add'.)
    _calibration(1, 0, ops=frozenset(["a/body/_1/a/add", "b/body/_1/mul"])).check_measures(graph)
    other = _calibration(1, 0, ops=frozenset(["c", "d", "a"]))
    with pytest.raises(memsave.MemsaveError, match="calibration is of another step.*'c'"):
        other.check_measures(graph)


def test_bad_calibration_inputs_are_refused_with_what_to_pass():
    with pytest.raises(memsave.MemsaveError, match="step is a int; pass the callable"):
        memsave.calibrate_memory(3)
    with pytest.raises(memsave.MemsaveError, match="calibration is a str; pass what "
                                                   "memsave.calibrate_memory"):
        memsave.budget(0.5, calibration="measured")


@pytest.mark.skipif(os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("true", "1")
                    or bool(tf.config.list_physical_devices("GPU")),
                    reason="needs a CPU allocator that keeps no peak")
def test_calibrating_without_an_allocator_that_keeps_peaks_says_how_to_get_one():
    with pytest.raises(memsave.MemsaveError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
        memsave.calibrate_memory(lambda: None)


def test_while_calibrating_plain_tf_gradients_answers_and_the_report_says_why():
    with tf.Graph().as_default():
        x = tf.constant(np.arange(4.0))
        y = tf.reduce_sum(tf.tanh(x) * tf.tanh(x))
        with answered_by_tf_gradients(), memsave.always_rewrite():
            grads = memsave.gradients(y, [x], checkpoints="memory")
        assert "calibrate_memory is measuring" in memsave.last_report().fallback
        with tf.compat.v1.Session() as sess:
            np.testing.assert_allclose(sess.run(grads[0]),
                                       sess.run(tf.gradients(y, [x])[0]), rtol=1e-12)
        with pytest.raises(memsave.MemsaveError, match="unknown checkpoints strategy"):
            with answered_by_tf_gradients():
                memsave.gradients(y, [x], checkpoints="fastest")
