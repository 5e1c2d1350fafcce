"""Keras 2 (`tf_keras`): its models differentiated by memsave, and its `fit` under
memsave.patch planned for the batch it is given with its optimizer's slots.

Keras 2 fuses its batch norm in float32 (FusedBatchNormV3, whose reserve spaces the
memory model knows), builds its optimizer inside the first step (after the gradients are planned),
and traces its train function with a batch of None, as Keras 3 does. Skipped where
tf_keras is not installed; .ci/run installs the release matching TensorFlow's
(`pip install "tf-keras==X.Y.*"` for TensorFlow X.Y).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import memsave

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


def _bn_cnn(blocks=4, channels=8, size=16):
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


@pytest.mark.parametrize("strategy", ["memory", "speed"])
@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_a_keras_2_batch_norm_cnn_is_exact(strategy, dtype, rtol):
    """In float64 (where Keras 2's batch norm is not fused: exactness cannot hide) and in
    float32, where it runs FusedBatchNormV3 and memsave recomputes it."""
    with _floatx(dtype):
        model = _bn_cnn()
    x = np.random.RandomState(0).standard_normal([4, 16, 16, 8]).astype(dtype)
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


def test_keras_2_fit_under_the_patch_is_planned_for_its_batch_with_adams_slots():
    """A partial last batch makes Keras 2 trace its step with a batch of None: the patch
    plans it for fit's batch_size (not 1), holds Adam's two slots per weight beside the
    gradients (Keras 2 makes them after the gradients, in the first step), and trains
    exactly as plain fit does."""
    rng = np.random.RandomState(1)
    x = rng.standard_normal([2 * BATCH + 1, 16, 16, 8]).astype(np.float32)
    y = rng.randint(0, 10, [2 * BATCH + 1])

    def fit():
        model = _bn_cnn()
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
        return model, history.history["loss"]

    _, plain = fit()
    with memsave.patch(checkpoints="memory"):
        model, patched = fit()
    report = memsave.last_report()
    np.testing.assert_allclose(patched, plain, rtol=1e-6)
    assert report.unknown_dims and report.unknown_dim_size == BATCH, report
    assert f"from fit's batch_size={BATCH}" in str(report), report
    weight_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_variables)
    assert report.beside_bytes >= 2 * weight_bytes, (report.beside_bytes, weight_bytes)
    # (The optimizer the patched fit built holds what the plan counted for it.)
    slots = sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables
                if v.shape.rank)
    assert slots == 2 * weight_bytes
