"""Keras 2 (`tf_keras`): its models differentiated by memsave, and its `fit` under
memsave.patch planned for the batch it is given with its optimizer's slots.

Keras 2 fuses its batch norm in float32 (FusedBatchNormV3, whose reserve spaces the
memory model knows), builds its optimizer inside the first step (after the gradients are planned),
and traces its train function with a batch of None, as Keras 3 does. Skipped where
tf_keras is not installed, but where MEMSAVE_REQUIRE_TF_KERAS is set (CI's .ci/run,
which installs the release matching TensorFlow's: `pip install "tf-keras==X.Y.*"` for
TensorFlow X.Y), where the import fails instead.
"""

import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf

import memsave

if os.environ.get("MEMSAVE_REQUIRE_TF_KERAS"):
    import tf_keras
else:
    tf_keras = pytest.importorskip("tf_keras")

BATCH = 16


@contextlib.contextmanager
def _floatx(name):
    previous = tf_keras.backend.floatx()
    tf_keras.backend.set_floatx(name)
    try:
        yield
    finally:
        tf_keras.backend.set_floatx(previous)


def _bn_cnn(blocks=3, channels=8, size=8):
    """Conv-BN-ReLU residual blocks, a pooled Dense head (tf_keras, functional)."""
    tf_keras.utils.set_random_seed(0)
    layers = tf_keras.layers
    inputs = tf_keras.Input((size, size, channels))
    h = inputs
    for _ in range(blocks):
        r = h
        h = layers.ReLU()(layers.BatchNormalization()(
            layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)))
        h = layers.BatchNormalization()(layers.Conv2D(channels, 3, padding="same")(h))
        h = layers.ReLU()(layers.Add()([h, r]))
    outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(h))
    return tf_keras.Model(inputs, outputs)


@pytest.mark.parametrize("dtype, rtol, strategy", [("float64", 1e-12, "memory"),
                                                   ("float32", 1e-5, "speed")])
def test_a_keras_2_batch_norm_cnn_is_exact(dtype, rtol, strategy):
    """In float64 (where Keras 2's batch norm is not fused: exactness cannot hide) and in
    float32, where it runs FusedBatchNormV3 and memsave recomputes it."""
    with _floatx(dtype):
        model = _bn_cnn()
    x = np.random.RandomState(0).standard_normal([4, 8, 8, 8]).astype(dtype)
    weights = model.trainable_variables

    @tf.function
    def step(gradients):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        return gradients(loss, weights)

    expected = step(tf.gradients)
    got = step(lambda loss, xs: memsave.gradients(loss, xs, checkpoints=strategy))
    report = memsave.last_report()
    assert report.segments, report  # (rewritten: the comparison below tests something)
    fused = any(op.type == "FusedBatchNormV3" for op in
                step.get_concrete_function(tf.gradients).graph.get_operations())
    assert fused == (dtype == "float32")
    for e, g, w in zip(expected, got, weights):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=rtol, atol=rtol * 1e-2,
                                   err_msg=w.name)


def test_no_segment_waits_for_a_bias_gradient_onednn_merges_into_the_next():
    """'speed' ends segments between a convolution and its bias: the bias's BiasAddGrad
    and the next segment's Conv2DBackpropFilter read one gradient, and oneDNN's graph
    pass merges the two. Where the next segment's copies waited for the BiasAddGrad,
    the merged op closed a cycle ("104 nodes in a cycle", AMD EPYC with AVX-512)."""
    model = _bn_cnn()
    x = np.random.RandomState(0).standard_normal([4, 8, 8, 8]).astype("float32")

    @tf.function
    def step():
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        return memsave.gradients(loss, model.trainable_variables, checkpoints="speed")

    graph = step.get_concrete_function().graph
    waits = [op for op in graph.get_operations()
             if op.type == "NoOp" and "previous_backward_done" in op.name]
    assert waits, "no segment waits for the one before: nothing is tested"
    assert not [c.name for op in waits for c in op.control_inputs if c.type == "BiasAddGrad"]


def test_a_gradient_computed_from_returned_gradients_alone_is_not_waited_for():
    """ordering.made_from_only: a bias's gradient, BiasAddGrad of a gradient the
    segment returns and Keras 3's reshape of it, computes from that gradient alone (a
    Keras ViT's patch convolution under a budget closed a 7-node cycle when the next
    segment waited for it, AMD EPYC with AVX-512); a kernel's, which reads the
    activation too, does not, nor an op reading a tensor made before the segment."""
    from memsave import ordering
    from memsave.graph.select import TensorSet
    with tf.Graph().as_default() as graph:
        activation = tf.compat.v1.placeholder(tf.float32, [16, 8])
        returned = tf.compat.v1.placeholder(tf.float32, [16, 4])
        made_before = len(graph.get_operations()) - 1
        bias = tf.reshape(tf.raw_ops.BiasAddGrad(out_backprop=returned), [1, 4])
        kernel = tf.matmul(activation, returned, transpose_a=True)
        shape_only = tf.zeros(tf.shape(activation)) + tf.reduce_sum(returned)
        forward = activation * 2.0
        tensors = TensorSet([returned])
        assert ordering.made_from_only(bias.op, tensors, made_before)
        assert ordering.made_from_only(shape_only.op, tensors, made_before)
        assert not ordering.made_from_only(kernel.op, tensors, made_before)
        assert not ordering.made_from_only(forward.op, tensors, made_before)


def _fitted(model, x, y, patched):
    """The loss of one epoch of `model.fit` (three batches, compiled with Adam), under
    memsave.patch("memory") where `patched`."""
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    context = memsave.patch(checkpoints="memory") if patched else contextlib.nullcontext()
    with context:
        history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return history.history["loss"]


def _optimizer_bytes(model):
    return sum(int(np.prod(v.shape)) * v.dtype.size for v in model.optimizer.variables)


def test_keras_2_fit_under_the_patch_is_planned_for_its_batch_with_adams_slots():
    """A partial last batch makes Keras 2 trace its step with a batch of None: the patch
    plans it for fit's batch_size (not 1), holds what Adam holds beside the gradients
    (its slots, which Keras 2 makes after the gradients, in the first step) and trains
    exactly as plain fit does."""
    rng = np.random.RandomState(1)
    x = rng.standard_normal([2 * BATCH + 1, 8, 8, 8]).astype(np.float32)
    y = rng.randint(0, 10, [2 * BATCH + 1])
    plain = _fitted(_bn_cnn(), x, y, patched=False)
    model = _bn_cnn()
    patched = _fitted(model, x, y, patched=True)
    report = memsave.last_report()
    np.testing.assert_allclose(patched, plain, rtol=1e-6)
    assert report.segments, report
    assert report.unknown_dims and report.unknown_dim_size == BATCH, report
    assert f"from fit's batch_size={BATCH}" in str(report), report
    # Exactly what the optimizer holds once built: its step count and two slots a weight.
    assert report.beside_bytes == _optimizer_bytes(model), report


def test_keras_2_optimizer_of_one_weight_is_counted_before_it_is_built():
    """An unbuilt Keras 2 optimizer already holds its step count: with one weight it has
    as many variables as the model has weights, and is still not built."""
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(10, use_bias=False)])
    rng = np.random.RandomState(2)
    x, y = rng.standard_normal([2 * BATCH + 1, 4]).astype(np.float32), rng.randint(0, 10, [33])
    _fitted(model, x, y, patched=True)
    assert memsave.last_report().beside_bytes == _optimizer_bytes(model)


def test_memsave_keras_names_the_patch_for_a_keras_2_model():
    with pytest.raises(memsave.MemsaveError, match=r"Keras 2 \(tf_keras\) model .*memsave.patch"):
        memsave.keras.enable(_bn_cnn(blocks=1))
