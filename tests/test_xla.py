"""memsave under XLA: the recomputation survives tf.function(jit_compile=True) (issue 10).

XLA drops control inputs and merges equal computations, so copies that only wait
for their segment's gradient through control inputs would be merged back into the
forward pass. Under XLA memsave's copies read their inputs through a data
dependency on that gradient (memsave.xla_gates). These tests count the dot
and convolution ops of the optimized HLO (forward + recomputation + backward, not
forward + backward) and compare every gradient with tf.gradients' in float64.
Measured peaks under XLA are in tests/test_memory.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.measure import hlo_op_counts

from _gradcheck import is_copy


def _mlp_weights(layers, width, dtype, seed=0):
    rng = np.random.RandomState(seed)
    return [tf.Variable((rng.standard_normal([width, width]) / np.sqrt(width)).astype(dtype))
            for _ in range(layers)]


def _mlp_step(weights, gradients, jit=True):
    @tf.function(jit_compile=jit, autograph=False)
    def step(x):
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        return gradients(loss, weights)
    return step


def _memsave(checkpoints="memory"):
    return lambda ys, xs: memsave.gradients(ys, xs, checkpoints=checkpoints)


def _recomputed(step, x, op_type):
    """Recomputed ops of `op_type` that run: whose outputs an op that is not a copy
    reads, or a copy that runs (a copy that ends a segment and whose gradient does not
    read its output, or reads the kept checkpoint, is dead code, which XLA removes)."""
    graph = step.get_concrete_function(x).graph
    copies = [op for op in graph.get_operations() if is_copy(op)]
    running = set()
    for op in reversed(copies):  # (made producers first)
        if any(c in running or not is_copy(c) for t in op.outputs for c in t.consumers()):
            running.add(op)
    return sum(1 for op in running if op.type == op_type)


@pytest.mark.parametrize("checkpoints", ["memory", "every_fourth"])
def test_the_optimized_hlo_holds_the_recomputed_matmuls(checkpoints):
    layers = 16
    weights = _mlp_weights(layers, 32, np.float32)
    x = tf.constant(np.random.RandomState(1).standard_normal([64, 32]).astype(np.float32))
    plain = _mlp_step(weights, tf.gradients)
    if checkpoints == "every_fourth":
        def checkpoints(region):
            return [op.outputs[0] for op in region.ops if op.type == "Tanh"][3::4]
    step = _mlp_step(weights, _memsave(checkpoints))
    tf_dots = hlo_op_counts(plain, x)["dot"]
    memsave_dots = hlo_op_counts(step, x)["dot"]
    recomputed = _recomputed(step, x, "MatMul")
    assert memsave.last_report().segments
    assert tf_dots >= 3 * layers - 1  # forward + backward
    assert recomputed >= layers // 2
    # Forward + recomputation + backward: XLA merged no copy back into the forward pass.
    assert memsave_dots == tf_dots + recomputed, (tf_dots, memsave_dots, recomputed)


def test_the_optimized_hlo_holds_the_recomputed_convolutions():
    rng = np.random.RandomState(0)
    filters = [tf.Variable((rng.standard_normal([3, 3, 4, 4]) * 0.2).astype(np.float32))
               for _ in range(8)]

    def make(gradients):
        @tf.function(jit_compile=True, autograph=False)
        def step(images):
            h = images
            for f in filters:
                h = tf.nn.relu(tf.nn.conv2d(h, f, 1, "SAME")) + h
            return gradients(tf.reduce_sum(h * h), filters)
        return step

    images = tf.constant(rng.standard_normal([2, 8, 8, 4]).astype(np.float32))
    step = make(_memsave())
    plain_convs = hlo_op_counts(make(tf.gradients), images)["convolution"]
    memsave_convs = hlo_op_counts(step, images)["convolution"]
    recomputed = _recomputed(step, images, "Conv2D")
    assert recomputed >= 4
    assert memsave_convs == plain_convs + recomputed, (plain_convs, memsave_convs, recomputed)


@pytest.mark.parametrize("checkpoints", ["memory", "speed", "collection_every_other"])
def test_gradients_under_xla_equal_tf_gradients_in_float64(checkpoints):
    weights = _mlp_weights(8, 16, np.float64)
    x = tf.constant(np.random.RandomState(2).standard_normal([8, 16]))
    expected = _mlp_step(weights, tf.gradients)(x)
    if checkpoints == "collection_every_other":
        def checkpoints(region):
            return [op.outputs[0] for op in region.ops if op.type == "Tanh"][1::2]
    got = _mlp_step(weights, _memsave(checkpoints))(x)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12, atol=1e-14)


def test_without_xla_the_rewrite_has_no_data_gate():
    weights = _mlp_weights(8, 16, np.float32)
    x = tf.ones([4, 16])
    for jit, gated in ((False, False), (True, True)):
        step = _mlp_step(weights, _memsave(), jit=jit)
        ops = step.get_concrete_function(x).graph.get_operations()
        assert any("xla_gate" in op.name for op in ops) == gated


def test_a_jit_compiled_function_called_from_a_plain_one_is_gated():
    weights = _mlp_weights(8, 16, np.float32)
    inner = _mlp_step(weights, _memsave(), jit=True)

    @tf.function(autograph=False)
    def outer(x):
        return inner(x)

    x = tf.ones([4, 16])
    outer(x)
    ops = inner.get_concrete_function(x).graph.get_operations()
    assert any("xla_gate" in op.name for op in ops)


@pytest.mark.parametrize("checkpoints", ["memory", "speed"])
def test_cnn_gradients_under_xla_equal_tf_gradients_in_float64(checkpoints):
    # In float32 XLA compiles the two steps into differently fused programs, and batch
    # norm amplifies their rounding differences (compare.py --jit shows up to 1e-2 for
    # 'speed' on the default CNN); in float64 they agree to rounding.
    rng = np.random.RandomState(0)
    width, blocks = 8, 6
    stem = tf.Variable((rng.standard_normal([3, 3, 3, width]) * 0.2))
    convs = [(tf.Variable(rng.standard_normal([3, 3, width, width]) * 0.1),
              tf.Variable(np.ones(width)), tf.Variable(np.zeros(width))) for _ in range(blocks)]
    weights = [stem] + [v for conv in convs for v in conv]

    def make(gradients):
        @tf.function(jit_compile=True, autograph=False)
        def step(images):
            h = tf.nn.relu(tf.nn.conv2d(images, stem, 1, "SAME"))
            for w, scale, offset in convs:
                y = tf.nn.conv2d(h, w, 1, "SAME")
                mean, variance = tf.nn.moments(y, [0, 1, 2])
                h = tf.nn.relu(h + tf.nn.batch_normalization(y, mean, variance, offset, scale,
                                                             1e-3))
            return gradients(tf.reduce_mean(h * h), weights)
        return step

    images = tf.constant(rng.standard_normal([4, 16, 16, 3]))
    expected = make(tf.gradients)(images)
    got = make(_memsave(checkpoints))(images)
    assert memsave.last_report().segments
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-13)


def test_deferred_filter_gradients_compile_under_xla_and_equal_tf_gradients():
    # A wide 3x3 head at 2x2 pixels: its filter gradient (9.4 MB in float64) is made last.
    # Under XLA it waits on a conditional on its data inputs only: its filter sizes must
    # stay a compile-time constant.
    rng = np.random.RandomState(3)
    trunk = [tf.Variable(rng.standard_normal([3, 3, 4, 4]) * 0.2) for _ in range(4)]
    wide = tf.Variable(rng.standard_normal([3, 3, 4, 256]) * 0.2)
    head = tf.Variable(rng.standard_normal([3, 3, 256, 256]) * 0.02)
    variables = trunk + [wide, head]

    def make(gradients):
        @tf.function(jit_compile=True, autograph=False)
        def step(images):
            h = images
            for f in trunk:
                h = tf.nn.relu(tf.nn.conv2d(h, f, 1, "SAME"))
            h = tf.nn.avg_pool2d(h, 8, 8, "VALID")
            h = tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(h, wide, 1, "SAME")), head, 1, "SAME")
            return gradients(tf.reduce_sum(h * h), variables)
        return step

    images = tf.constant(rng.standard_normal([2, 16, 16, 4]))
    expected = make(tf.gradients)(images)
    got = make(_memsave())(images)
    assert memsave.last_report().deferred_gradients >= 1
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)
