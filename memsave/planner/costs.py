"""The cost model: what running an op again costs on a machine.

Every cost of the planner is in one unit, FLOPs of the machine's matmuls and
convolutions: a matmul or a convolution costs its FLOPs (opinfo.flops); any
other op costs its output elements times a per-element price, because on real
hardware elementwise ops, reductions and normalisations are bound by memory
traffic, not arithmetic (on the CPU measured, a ReLU or an add over an element
of a large tensor takes as long as ~35 FLOPs of a convolution, a training-mode
batch norm ~80); each op run and each recomputed segment costs a fixed overhead
on top.

`calibrate()` measures those prices on the machine it runs on (a few seconds);
`use(costs)` makes a Costs the one the planner uses, for the block it wraps.
DEFAULT_COSTS were measured on this project's CI-class machine (AMD EPYC, 2
cores, TensorFlow 2.21, oneDNN on) with `calibrate()`.
"""

import contextlib
import dataclasses
import threading
import time

import numpy as np

from memsave.errors import MemsaveError, MemsaveTypeError
from memsave.planner import opinfo

# Batch/layer normalisations: computing the statistics and applying them takes
# several passes over the data.
NORMALISATION_OP_TYPES = frozenset([
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "_FusedBatchNormEx", "LayerNorm",
])


# A backward pass runs about twice the FLOPs of its forward pass (the gradients
# with respect to an op's inputs and to its weights).
BACKWARD_TO_FORWARD = 2


@dataclasses.dataclass(frozen=True)
class Costs:
    """What running ops costs on one machine, in FLOPs of its matmuls/convolutions.

    Attributes:
      per_element: per output element of an op that is neither a matmul, a
        convolution nor a normalisation (elementwise ops, reductions, casts, ...).
      per_normalised_element: per output element of a normalisation
        (NORMALISATION_OP_TYPES).
      op_overhead: per op run (the executor's dispatch, an allocation, a launch).
      segment_overhead: per recomputed segment (its boundaries, ordering, and the
        gradient bookkeeping of one more backward call).
      source: where the figures come from (a machine, or 'uncalibrated': one
        FLOP per element, ~10 us per op at the ~10 GFLOP/s of a CPU core on small
        kernels, a segment as five ops).
    """
    per_element: float = 1.0
    per_normalised_element: float = 1.0
    op_overhead: float = 100_000
    segment_overhead: float = 500_000
    source: str = "uncalibrated"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type is float and not (isinstance(value, (int, float))
                                            and 0 <= value < float("inf")):
                raise MemsaveError(f"Costs.{field.name} is {value!r}; pass a number >= 0 "
                                   "(FLOPs of the machine's matmuls and convolutions)")

    def of(self, op):
        """What running `op` once costs (without the per-op overhead)."""
        if op.type in opinfo.HEAVY_OP_TYPES:
            return opinfo.flops(op)
        elements = opinfo.output_elements(op)
        if op.type in NORMALISATION_OP_TYPES:
            return int(elements * self.per_normalised_element)
        return int(elements * self.per_element)


def transfer_flops(out_bytes, back_bytes, copies, forward_flops, flops_per_byte, op_overhead):
    """What host offload costs a step, in FLOPs of the device.

    Transfers run beside the computation (a GPU's copy engines, one per direction),
    so only the part of a transfer that outlasts the computation it overlaps slows
    the step: the copies out overlap the forward pass, the copies back the backward
    pass. Each copy also costs an op's overhead.

    Args:
      out_bytes, back_bytes: bytes moved to the host and back per step.
      copies: how many copy ops move them.
      forward_flops: the forward pass's cost (its backward's is BACKWARD_TO_FORWARD x).
      flops_per_byte: the device's FLOP rate over the host link's bandwidth.
      op_overhead: what one copy op costs besides its transfer.
    """
    out = max(out_bytes * flops_per_byte - forward_flops, 0)
    back = max(back_bytes * flops_per_byte - BACKWARD_TO_FORWARD * forward_flops, 0)
    return int(out + back + copies * op_overhead)


# Measured with calibrate() on an AMD EPYC (2 cores, TensorFlow 2.21, oneDNN on):
# three runs gave per_element 27.5-40.9, per_normalised_element 76.8-86.7,
# op_overhead 11k-17k, segment_overhead 436k-836k; these are their middles.
DEFAULT_COSTS = Costs(per_element=35.0, per_normalised_element=80.0, op_overhead=15_000,
                      segment_overhead=600_000,
                      source="calibrate() on an AMD EPYC, 2 cores, TensorFlow 2.21")

_state = threading.local()


def active():
    """The Costs the planner uses now (DEFAULT_COSTS unless `use` says otherwise)."""
    return getattr(_state, "costs", DEFAULT_COSTS)


@contextlib.contextmanager
def use(costs):
    """Makes `costs` the planner's cost model inside the block (restored on exit).

        with memsave.planner.costs.use(memsave.planner.costs.calibrate()):
            grads = memsave.gradients(loss, params, checkpoints=memsave.budget(0.5))

    Raises:
      MemsaveTypeError: when `costs` is not a Costs.
    """
    if not isinstance(costs, Costs):
        raise MemsaveTypeError(f"use() takes a memsave.planner.Costs, got "
                               f"{type(costs).__name__}; build one with Costs(...) or calibrate()")
    previous = active()
    _state.costs = costs
    try:
        yield costs
    finally:
        _state.costs = previous


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
      A Costs.
    """
    import tensorflow as tf  # (the planner reads graphs only; timing needs the runtime)

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
                if run:  # (the first run traces and warms up)
                    best[index] = min(best[index], time.perf_counter() - start)
        return max(best[0] - best[1], 0.0)

    # Each graph reduces its result to one number: what comes back costs nothing.
    images, kernel = constant(16, 32, 32, 64), constant(3, 3, 64, 64)
    conv = 2 * 16 * 32 * 32 * 64 * 9 * 64 / extra(
        lambda x, w: tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME")),
        lambda x, w: tf.reduce_sum(x), images, kernel)
    a = constant(1024, 1024)
    matmul = 2 * 1024 ** 3 / extra(lambda x: tf.reduce_sum(tf.matmul(x, x)), tf.reduce_sum, a)
    rate = float(np.sqrt(conv * matmul))  # FLOP/s of the heavy ops

    big = constant(32, 64, 64, 64)  # 8M elements: data from memory, not from caches
    elements = int(np.prod(big.shape))
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
    overhead = extra(chain(1000), chain(200), tiny) / 800
    segment = _segment_overhead(extra, constant(64, 64))
    return Costs(per_element=round((relu + add) / 2 / elements * rate, 1),
                 per_normalised_element=round(norm / elements * rate, 1),
                 op_overhead=round(overhead * rate, -3),
                 segment_overhead=round(segment * rate, -3),
                 source=source or "calibrate() on this machine")


def _segment_overhead(extra, x, length=200):
    """Seconds one more segment adds to a step: the gradients of a chain of tanh(x * c)
    with every product kept, so each segment recomputes one tanh (whose gradient reads
    its output), against plain tf.gradients, per segment. (Before segments could read
    their checkpoints, this kept every tanh output, and each segment recomputed that tanh
    and the product before it: the defaults above were measured so.)"""
    import tensorflow as tf

    from memsave import rewrite

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
