"""Measuring what the planner's models assume, on this machine.

- `memsave.calibrate()` times compiled graphs, memsave's rewrite among them, and returns
  the cost model's prices (memsave.planner.costs holds them and the defaults measured
  with it);
- `memsave.calibrate_memory(step, ...)` runs one training step with plain tf.gradients
  and reads the allocator's peak and what was alive at it: a budget given that
  calibration is a fraction of the *measured* peak, and the memory model's predictions
  are scaled to it (memsave.planner.calibrated).

Both run TensorFlow, memsave's rewrite among it, so they sit above the planner.
"""

import dataclasses
import os
import tempfile
import time
import warnings

import numpy as np
import tensorflow as tf

from memsave import rewrite
from memsave.errors import MemsaveError, MemsaveWarning
from memsave.graph import _tf_private
from memsave.planner.calibrated import Allocation, MemoryCalibration
from memsave.planner.costs import Costs


# The sizes calibrate() times: costs_from_timings turns seconds into prices with them.
CONV_FLOPS = 2 * 16 * 32 * 32 * 64 * 9 * 64  # a 3x3 convolution, 64 -> 64 channels
MATMUL_FLOPS = 2 * 1024 ** 3                  # a 1024 x 1024 product
ELEMENTS = 32 * 64 * 64 * 64                  # 8M elements: data from memory, not caches


@dataclasses.dataclass(frozen=True)
class CalibrationTimings:
    """Seconds calibrate() measured, each beyond a reference graph that differs only in
    what is measured.

    Attributes:
      conv, matmul: one CONV_FLOPS convolution, one MATMUL_FLOPS matmul.
      relu, add, norm: a ReLU, an add and a training batch norm over ELEMENTS elements.
      per_op: one more op in a chain of tiny ops.
      per_segment: one more segment of memsave's rewrite.
    """
    conv: float
    matmul: float
    relu: float
    add: float
    norm: float
    per_op: float
    per_segment: float


def calibrate(repeats=15, source=None):
    """Measures this machine's Costs: a convolution's and a matmul's FLOP rate, the
    time per element of a ReLU, an add and a training batch norm, per op of a chain
    of tiny ops, and per segment of a rewrite that recomputes nothing (a few seconds).

    Each figure is the difference between two compiled graphs that differ only in
    what is measured, run alternately `repeats` times; the fastest run of each is
    kept (the least disturbed by other work on the machine).

    Args:
      repeats: runs per graph.
      source: a name for the machine (default: 'calibrate() on this machine').
    Returns:
      A memsave.planner.Costs, for memsave.planner.costs.use(costs).
    Raises:
      MemsaveError: where a convolution or a matmul measured no time (see
        costs_from_timings).
    """
    return costs_from_timings(measure_timings(repeats), source)


def costs_from_timings(timings, source=None):
    """The cost model's prices from measured seconds: the FLOP rate of the heavy ops
    (the geometric mean of the convolution's and the matmul's), and every other price
    as that many FLOPs.

    Args:
      timings: a CalibrationTimings.
      source: a name for the machine (default: 'calibrate() on this machine').
    Returns:
      A memsave.planner.Costs.
    Raises:
      MemsaveError: where the convolution or the matmul took no measurable time (no
        FLOP rate can be taken from it).
    """
    for name in ("conv", "matmul"):
        if not getattr(timings, name) > 0:
            raise MemsaveError(
                f"calibrate: the {name} measured {getattr(timings, name)!r} s beyond its "
                "reference, so no FLOP rate can be taken from it; run calibrate() again "
                "with more repeats on a quieter machine")
    rate = float(np.sqrt(CONV_FLOPS / timings.conv * MATMUL_FLOPS / timings.matmul))
    return Costs(per_element=round((timings.relu + timings.add) / 2 / ELEMENTS * rate, 1),
                 per_normalised_element=round(timings.norm / ELEMENTS * rate, 1),
                 op_overhead=round(timings.per_op * rate, -3),
                 segment_overhead=round(timings.per_segment * rate, -3),
                 source=source or "calibrate() on this machine")


def measure_timings(repeats=15):
    """Times the graphs calibrate() prices the machine by.

    Args:
      repeats: runs per graph; the fastest is kept.
    Returns:
      A CalibrationTimings (seconds; a difference that came out negative is 0).
    """
    rng = np.random.default_rng(0)

    def constant(*shape):
        return tf.constant(rng.standard_normal(shape).astype(np.float32))

    def extra(measured, reference, *args):
        """Seconds `measured(*args)` takes beyond `reference(*args)`."""
        graphs = [tf.function(fn, autograph=False) for fn in (measured, reference)]
        best = [float("inf")] * 2
        for run in range(repeats + 1):
            for index, graph in enumerate(graphs):
                start = time.perf_counter()
                graph(*args).numpy()
                seconds = time.perf_counter() - start
                if run:  # (the first run traces and warms up)
                    best[index] = min(best[index], seconds)
        return max(best[0] - best[1], 0.0)

    # Each graph reduces its result to one number: what comes back costs nothing.
    images, kernel = constant(16, 32, 32, 64), constant(3, 3, 64, 64)
    conv = extra(lambda x, w: tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME")),
                 lambda x, w: tf.reduce_sum(x), images, kernel)
    a = constant(1024, 1024)
    matmul = extra(lambda x: tf.reduce_sum(tf.matmul(x, x)), tf.reduce_sum, a)

    big = constant(32, 64, 64, 64)
    relu = extra(lambda x: tf.reduce_sum(tf.nn.relu(x)), tf.reduce_sum, big)
    add = extra(lambda x: tf.reduce_sum(x + x), tf.reduce_sum, big)
    scale, offset = tf.ones([64]), tf.zeros([64])
    norm = extra(lambda x: tf.reduce_sum(tf.compat.v1.nn.fused_batch_norm(
        x, scale, offset, is_training=True)[0]), tf.reduce_sum, big)

    def chain(length):
        def run(x):  # (sin: nothing Grappler folds or fuses)
            for _ in range(length):
                x = tf.sin(x)
            return x
        return run
    tiny = constant(16)  # (a scalar argument gets folded away)
    per_op = extra(chain(1000), chain(200), tiny) / 800
    per_segment = _segment_overhead(extra, constant(64, 64))
    return CalibrationTimings(conv=conv, matmul=matmul, relu=relu, add=add, norm=norm,
                              per_op=per_op, per_segment=per_segment)


def _segment_overhead(extra, x, length=200):
    """Seconds one more segment adds to a step: the gradients of a chain of tanh(x * c)
    with every product kept, so each segment recomputes one tanh (whose gradient reads
    its output), against plain tf.gradients, per segment. (Before segments could read
    their checkpoints, this kept every tanh output, and each segment recomputed that tanh
    and the product before it: the defaults above were measured so.)"""
    def step(kind):
        def run(x):
            h, outputs = x, []
            for _ in range(length):
                product = h * 1.001
                outputs.append(product)
                h = tf.tanh(product)
            loss = tf.reduce_sum(h)
            if kind == "plain":
                return tf.gradients(loss, [x])[0]
            with rewrite.always_rewrite():
                return rewrite.gradients(loss, [x], checkpoints=outputs[1:])[0]
        return run
    return extra(step("memsave"), step("plain"), x) / (length - 1)


def calibrate_memory(step, *args, **kwargs):
    """Runs `step(*args, **kwargs)` with plain tf.gradients answering memsave's gradient
    calls in it, and measures the allocator's peak and what was alive at it.

    The step runs twice: once to trace and warm up, once measured (the allocator's peak
    statistics reset, the profiler recording which op made each buffer); what it does
    to variables (an optimizer's update) it does twice. A tf.function
    is run as a fresh tf.function of the same Python function, so the step's own traces
    (which memsave's gradients build) are left as they are. For a tf.compat.v1 graph,
    pass a callable that runs the step's tf.gradients fetches in your session, built
    once outside it: `grads = tf.gradients(loss, params)`, then
    `memsave.calibrate_memory(lambda: sess.run(grads, feed))`.

    Args:
      step: a callable running one training step (a tf.function, or a Python callable).
      *args, **kwargs: what to call it with.
    Returns:
      A MemoryCalibration, for `memsave.budget(..., calibration=...)`.
    Raises:
      MemsaveError: for a step that is not callable, a call while a graph is being built,
        a memsave gradients call in a tf.function nested in the step (its trace would
        stay answered by tf.gradients), or where the allocator keeps no peak (on a CPU:
        TF_CPU_ALLOCATOR_USE_BFC=true must be set before TensorFlow is imported).
    """
    if not callable(step):
        raise MemsaveError(f"calibrate_memory's step is a {type(step).__name__}; pass the "
                           "callable that runs one training step (e.g. your tf.function)")
    if tf.inside_function() or (not tf.executing_eagerly() and hasattr(step, "python_function")):
        raise MemsaveError("calibrate_memory runs the step; call it eagerly, outside any "
                           "tf.function or graph being built")
    from memsave import measure
    device = measure.memory_device()
    _check_allocator_keeps_peaks(device)
    traced = set()
    run = _tf_private.fresh_function(step, traced)
    # (A tf.function's calls are answered only in its fresh traces; another callable's,
    # a tf.compat.v1 session run say, wherever they are.)
    with rewrite.answered_by_tf_gradients(traced if run is not step else None):
        run(*args, **kwargs)
        before = tf.config.experimental.get_memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        with tempfile.TemporaryDirectory(prefix="memsave_calibration_") as logdir:
            profiling = _start_profiler(logdir)
            try:
                run(*args, **kwargs)
            finally:
                if profiling:
                    tf.profiler.experimental.stop()
            peak = tf.config.experimental.get_memory_info(device)["peak"]
            _check_allocator_keeps_peaks(device, peak)
            profile = _tf_private.memory_profile(logdir) if profiling else None
    if profile is None:
        warnings.warn("memsave.calibrate_memory: TensorFlow's profiler recorded nothing (another "
                      "profile being taken?): the peak is measured, but not what was alive at "
                      "it, so unknown dimensions and buffers no op made are not corrected",
                      MemsaveWarning, stacklevel=2)
    at_peak, ops, shapes = _records(profile, peak)
    return MemoryCalibration(peak_bytes=int(peak), before_bytes=int(before), device=device,
                             at_peak=at_peak, ops=ops, shapes=shapes,
                             profiled=profile is not None)


def _check_allocator_keeps_peaks(device, peak=None):
    """Raises MemsaveError where `device`'s allocator keeps no peak: a CPU's unless
    TF_CPU_ALLOCATOR_USE_BFC=true (TensorFlow then reports 0), or a measured `peak` of 0."""
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("true", "1")
    if (device.startswith("CPU") and not bfc) or peak == 0:
        raise MemsaveError(
            f"calibrate_memory reads the peak of {device}'s allocator, which keeps none "
            "here; on a CPU set TF_CPU_ALLOCATOR_USE_BFC=true in the environment before "
            "TensorFlow is imported (its BFC allocator keeps peaks)")


def _start_profiler(logdir):
    """Starts TensorFlow's profiler (its memory records say which op made each buffer);
    False where it cannot start (another profile is being taken): the peak is still read."""
    try:
        tf.profiler.experimental.start(logdir)
    except (tf.errors.AlreadyExistsError, tf.errors.UnavailableError):
        return False
    return True


def _records(profile, peak):
    """(the Allocations alive at the peak of the allocator that peaked at `peak`, largest
    first; the names of the ops that allocated; (op name, the shape of what it allocated)
    pairs) from a memory profile (or None)."""
    allocators = (profile or {}).get("memoryProfilePerAllocator", {})
    if not allocators:
        return (), frozenset(), ()
    chosen = min(allocators.values(), key=lambda a: abs(
        int(a["profileSummary"].get("peakStats", {}).get("peakBytesInUse", 0)) - peak))
    snapshots = chosen.get("memoryProfileSnapshots", [])
    special = chosen.get("specialAllocations", [])
    at_peak = []
    for active in chosen.get("activeAllocations", []):
        index, special_index = int(active["snapshotIndex"]), int(active["specialIndex"])
        if 0 <= index < len(snapshots):
            record = snapshots[index]["activityMetadata"]
        elif 0 <= special_index < len(special):
            record = special[special_index]
        else:  # (its snapshot was dropped: the converter keeps at most 1000)
            continue
        if " " in record.get("tfOpName", " "):  # ("unused preallocated device memory")
            continue
        at_peak.extend([Allocation(record["tfOpName"], record.get("regionType", ""),
                                   int(record.get("allocationBytes", 0)),
                                   record.get("dataType", ""), record.get("tensorShape", ""))]
                       * int(active.get("numOccurrences", 1)))
    made = [s["activityMetadata"] for s in snapshots]
    made = [record for record in made if " " not in record.get("tfOpName", " ")]
    shapes = {}
    for record in made:
        shapes.setdefault(record["tfOpName"], record.get("tensorShape", ""))
    return (tuple(sorted(at_peak, key=lambda a: -a.bytes)),
            frozenset(record["tfOpName"] for record in made), tuple(sorted(shapes.items())))
