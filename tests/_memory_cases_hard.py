"""Peak-memory configurations for the hard-graph tests (issue 6), one per process.

Run through memsave.measure.run_isolated("_memory_cases_hard:<name>", ...), which
turns the CPU BFC allocator on before TensorFlow is imported. Each function
returns the peak in MiB of one training-style step, a checksum of the gradients
and what kind of value the table's gradient was inside the graph.
"""

import numpy as np
import tensorflow as tf

import memsave
from memsave.measure import device_input, peak_memory_bytes


def _gradients(mode, ys, xs):
    if mode == "tf":
        return tf.gradients(ys, xs)
    return memsave.gradients(ys, xs, checkpoints=mode)


def _checksum(value):
    if isinstance(value, tf.IndexedSlices):
        # The sum of a scattered gradient is the sum of its values.
        return float(np.sum(value.values.numpy(), dtype=np.float64))
    return float(np.sum(value.numpy(), dtype=np.float64))


def embedding(mode, table="variable", vocab=200_000, dim=64, batch=4096, depth=30):
    """An embedding lookup into a large table (~51 MB) followed by a tanh chain.

    Args:
      mode: "tf" (tf.gradients) or a memsave strategy name.
      table: "variable" (a tf.Variable, looked up with ResourceGather) or
        "tensor" (a tensor argument of the tf.function, looked up with GatherV2).
      vocab, dim: the table's shape; batch: ids per step; depth: tanh layers.
    Returns:
      {"peak_mb", "checksum", "table_gradient": the gradient's class name}.
    """
    rng = np.random.RandomState(0)
    values = rng.uniform(-0.1, 0.1, [vocab, dim]).astype(np.float32)
    ids = tf.constant(rng.randint(0, vocab, [batch]).astype(np.int32))
    kinds = {}

    def forward_and_gradient(table_x, params):
        h = tf.nn.embedding_lookup(params, ids)
        for _ in range(depth):
            h = tf.tanh(h) * 1.5
        grad = _gradients(mode, tf.reduce_sum(h * h), [table_x])[0]
        kinds["table_gradient"] = type(grad).__name__
        return grad

    if table == "variable":
        variable = tf.Variable(values)

        @tf.function
        def step():
            return forward_and_gradient(variable, variable)
        args = ()
    elif table == "tensor":
        @tf.function
        def step(params):
            return forward_and_gradient(params, params)
        args = (device_input(values),)
    else:
        raise ValueError(f"table must be 'variable' or 'tensor', not {table!r}")

    step(*args)  # trace and warm up outside the measured call
    peak, grad = peak_memory_bytes(lambda: step(*args))
    return {"peak_mb": peak / 2**20, "checksum": _checksum(grad),
            "table_gradient": kinds["table_gradient"]}
