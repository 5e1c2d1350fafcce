"""Measuring the cost model's prices on this machine: `memsave.calibrate()`.

It times compiled graphs, memsave's rewrite among them, so it sits above the planner
(memsave.planner.costs holds the prices and the defaults measured with it).
"""

import time

import numpy as np
import tensorflow as tf

from memsave import rewrite
from memsave.planner.costs import Costs


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
