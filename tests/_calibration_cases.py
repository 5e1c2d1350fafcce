"""Steps that memsave.calibrate_memory measures, each in its own process.

Run through memsave.measure.run_isolated("_calibration_cases:<name>", ...) (the CPU
BFC allocator on). Each returns the calibration, the budget's plan and the measured
peak of the step memsave built, and how far its gradients are from tf.gradients'.
"""

import numpy as np
import tensorflow as tf

import memsave
from memsave.measure import peak_memory_bytes

from _models import tanh_mlp_loss

MIB = 2 ** 20


def _largest_relative_error(got, expected):
    return max(float(np.max(np.abs(g - e)) / max(np.max(np.abs(e)), 1e-300))
               for g, e in zip(got, expected))


def _report_fields(report):
    return {"calibrated_mb": (report.calibrated_peak_bytes or 0) / MIB,
            "measured_baseline_mb": (report.measured_baseline_peak_bytes or 0) / MIB,
            "memory_calibration": report.memory_calibration,
            "unknown_dim_size": report.unknown_dim_size, "fallback": report.fallback,
            "checkpoints": len(report.checkpoints), "summary": report.summary()}


def v1_unknown_batch(calibrated, fraction, layers=16, width=256, batch=2048, steps=25):
    """A tanh MLP in a tf.compat.v1 graph fed through a [None, width] placeholder (the
    model counts the batch as 1 unless told), float64, under a byte budget of `fraction`
    of tf.gradients' measured peak; `calibrated`: whether the budget has the calibration;
    the peak is the median of `steps` steps' (`peaks_mb`: each one)."""
    tf.compat.v1.disable_eager_execution()
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(tf.float64, [None, width])
    weights = [tf.Variable(rng.standard_normal([width, width]) / np.sqrt(width))
               for _ in range(layers)]
    loss = tanh_mlp_loss(x, weights)
    plain = tf.gradients(loss, weights)
    sess = tf.compat.v1.Session()
    sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: rng.standard_normal([batch, width])}
    calibration = memsave.calibrate_memory(lambda: sess.run(plain, feed))
    limit = int(fraction * calibration.peak_bytes)
    grads = memsave.gradients(loss, weights, checkpoints=memsave.budget(
        limit, calibration=calibration if calibrated else None))
    report = memsave.last_report()
    sess.run(grads, feed)
    # Which ops the executor runs side by side varies from step to step, and with it the
    # peak: the median of `steps` steps is the step's peak here, every one is returned.
    # (Steps measured 49.5-55.5 MiB or, about a third of them, 59-66.5; how many varies
    # from process to process. A median of nine steps was 62.0 in one CI run of 2.16;
    # of 25, it was 52.0-59.0 in six processes. AMD EPYC with AVX-512, TF 2.21.)
    # (Each step's results are dropped before the next: Session.run's arrays can share
    # the allocator's buffers, which would then be in use through the next step.)
    peaks = [peak_memory_bytes(lambda: sess.run(grads, feed))[0] / MIB for _ in range(steps)]
    got = sess.run(grads, feed)
    return dict(_report_fields(report), peak_mb=float(np.median(peaks)), peaks_mb=peaks,
                limit_mb=limit / MIB,
                calibration_mb=calibration.peak_bytes / MIB,
                predicted_mb=report.predicted_peak_bytes / MIB,
                largest_at_peak=[a.op for a in calibration.at_peak[:3]],
                error=_largest_relative_error(got, sess.run(plain, feed)))


def function_step(fraction, layers=16, width=256, batch=2048):
    """The same MLP as a tf.function whose memsave.budget reads the calibration from a
    holder: calibrated first (memsave answers with tf.gradients in a fresh trace), then
    run with it. Also says how many traces the step had after the calibration (0: the
    calibration left its traces alone)."""
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal([width, width]) / np.sqrt(width))
               for _ in range(layers)]
    holder = {}

    def loss_of(x):
        return tanh_mlp_loss(x, weights)

    @tf.function
    def step(x):
        budget = memsave.budget(fraction, calibration=holder.get("calibration"))
        return memsave.gradients(loss_of(x), weights, checkpoints=budget)

    @tf.function
    def plain(x):
        return tf.gradients(loss_of(x), weights)

    x = tf.constant(rng.standard_normal([batch, width]))
    holder["calibration"] = memsave.calibrate_memory(step, x)
    traces = step.experimental_get_tracing_count()
    step(x)
    report = memsave.last_report()
    peak, got = peak_memory_bytes(lambda: [g.numpy() for g in step(x)])
    calibration = holder["calibration"]
    return dict(_report_fields(report), traces_after_calibration=traces,
                peak_mb=peak / MIB, limit_mb=fraction * calibration.peak_bytes / MIB,
                calibration_mb=calibration.peak_bytes / MIB,
                error=_largest_relative_error(got,
                                              [g.numpy() for g in plain(x)]))


def nested_function_step():
    """A tf.function step whose memsave call sits in a nested tf.function: calibrating it
    must refuse (the nested function's trace would stay answered by tf.gradients) and
    leave the nested function's traces as they were."""
    weights = [tf.Variable(tf.ones([8, 8]))]

    @tf.function
    def inner(x):
        return memsave.gradients(tanh_mlp_loss(x, weights), weights, checkpoints="memory")

    @tf.function
    def step(x):
        return inner(x)

    try:
        memsave.calibrate_memory(step, tf.ones([4, 8]))
    except Exception as error:  # (AutoGraph passes it on as a StagingError, message kept)
        return {"error": str(error), "inner_traces": inner.experimental_get_tracing_count()}
    return {"error": None, "inner_traces": inner.experimental_get_tracing_count()}
