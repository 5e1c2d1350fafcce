"""Tensors a step computes from constants alone: Grappler folds them into one constant per
value, held for the function's life (memsave.planner.constant_folding)."""

import contextlib

import numpy as np
import tensorflow as tf

import memsave

LAYERS, BATCH, HEADS, LENGTH, WIDTH = 6, 4, 2, 64, 16
MASK_BYTES = BATCH * HEADS * LENGTH * LENGTH  # (bool)


def _causal_attention_loss(x, weights, batch):
    """Causal attention as Keras' MultiHeadAttention masks it: LogicalAnd(ones_like of the
    scores' shape, a band of ones), in each layer, read by a SelectV2 and its gradient."""
    h = x
    for w in weights:
        scores = tf.matmul(h, h, transpose_b=True)  # [batch, heads, length, length]
        ones = tf.fill(tf.stack([batch, HEADS, LENGTH, LENGTH]), True)
        band = tf.linalg.band_part(tf.fill([LENGTH, LENGTH], True), -1, 0)[None, None]
        masked = tf.where(tf.logical_and(ones, band), scores, -1e9)
        h = tf.tanh(tf.matmul(tf.nn.softmax(masked), h) @ w)
    return tf.reduce_sum(h * h)


@contextlib.contextmanager
def _constant_folding(on):
    before = tf.config.optimizer.get_experimental_options().get("constant_folding")
    tf.config.optimizer.set_experimental_options({"constant_folding": on})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {"constant_folding": True if before is None else before})


def _report(batch_spec, folding):
    rng = np.random.RandomState(0)
    weights = [tf.Variable(rng.standard_normal([WIDTH, WIDTH]).astype(np.float32) / 4)
               for _ in range(LAYERS)]
    reports = []

    @tf.function(input_signature=[tf.TensorSpec([batch_spec, HEADS, LENGTH, WIDTH])])
    def step(x):
        batch = BATCH if batch_spec else tf.shape(x)[0]
        reports.append(memsave.plan(_causal_attention_loss(x, weights, batch), weights,
                                    checkpoints="memory", unknown_dim_size=BATCH))
        return x

    with _constant_folding(folding):
        step.get_concrete_function()
    return reports[-1]


def test_a_mask_made_of_constants_in_every_layer_is_one_resident_constant():
    """Six layers' identical masks, built from static shapes, are one constant held
    between steps (what the allocator measures for Keras' GPT), not six forward
    tensors kept to their gradients; without constant folding, they are six."""
    folded, unfolded = _report(BATCH, True), _report(BATCH, False)
    assert folded.resident_bytes - unfolded.resident_bytes == MASK_BYTES
    # tf.gradients' step keeps every layer's mask to the backward pass without folding
    # (at its peak, all but the last layer's, which the backward pass reads first).
    assert (unfolded.baseline_peak_bytes - folded.baseline_peak_bytes
            >= (LAYERS - 2) * MASK_BYTES), (folded.baseline_peak_bytes,
                                            unfolded.baseline_peak_bytes)


def test_a_mask_whose_shape_comes_from_the_batch_at_run_time_stays_in_the_step():
    """With a batch of None, the ones' shape is known only when the step runs: only the
    band is folded (one constant), each layer's mask stays a forward tensor."""
    folded, unfolded = _report(None, True), _report(None, False)
    assert folded.resident_bytes - unfolded.resident_bytes == LENGTH * LENGTH
    assert abs(folded.baseline_peak_bytes - unfolded.baseline_peak_bytes) < MASK_BYTES
