"""Graph surgery with memsave.graph on a live graph, as people did with the old graph editor.

A small model reads an input placeholder `x` and produces `logits`, which a
consumer (`out`) reads. We graft a preprocessing subgraph (raw uint8 pixels ->
scaled, centred floats) in front of `x`, and a postprocessing subgraph (softmax,
then a temperature) between `logits` and its consumer, then check the values.
Each test runs in a v1 Graph and in a tf.function body.
"""

import numpy as np
import tensorflow as tf

from memsave import graph as ge
from memsave.graph import OpMatcher

RAW = np.array([[0, 51, 255], [255, 102, 0]], np.uint8)
X = np.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]], np.float32)
W = np.array([[1.0, -2.0], [0.5, 0.25], [-1.0, 3.0]], np.float32)
B = np.array([0.1, -0.2], np.float32)
MEAN = 0.5


def build_model(x):
    with tf.name_scope("model"):
        hidden = tf.tanh(tf.matmul(x, tf.constant(W)) + tf.constant(B), name="hidden")
        logits = tf.multiply(hidden, 3.0, name="logits")
    out = tf.identity(logits, name="out")
    return logits, out


def model_np(x):
    return 3.0 * np.tanh(x @ W + B)


def softmax_np(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_graft_pre_and_postprocessing(run_graph):
    def build(graph, inputs):
        x, raw = inputs["x"], inputs["raw"]
        logits, out = build_model(x)
        model_ops = ge.get_name_scope_ops(graph, "model")

        with tf.name_scope("pre"):
            pre = tf.cast(raw, tf.float32) / 255.0 - MEAN
        with tf.name_scope("post"):
            probs = tf.nn.softmax(logits)
            post = tf.multiply(probs, 2.0)
        post_ops = ge.get_name_scope_ops(graph, "post")

        # Keep a copy of the original model reading x, to compare against.
        reference = ge.copy_with_input_replacements(
            ge.get_backward_walk_ops(out, stop_at_ts=[x]), name_scope="reference")
        before = reference.transformed(out)

        # Splice pre in front of x: every model op that read x reads pre now.
        assert ge.reroute_ts(pre, x, can_modify=model_ops) == 1
        matmul = next(op for op in model_ops if op.type == "MatMul")
        assert [op.name for op in x.consumers()] == ["reference/" + matmul.name]
        # Splice post after logits: its readers, except post itself, read post.
        assert ge.reroute_ts(post, logits, cannot_modify=post_ops) == 1
        assert OpMatcher("out").input_ops(post)(out.op)
        assert OpMatcher("post/Softmax").input_ops("model/logits")(probs.op)
        # raw now reaches the model output; x only reaches the reference copy.
        downstream_of_raw = ge.get_forward_walk_ops(raw)
        assert out.op in downstream_of_raw and logits.op in downstream_of_raw
        assert out.op not in ge.get_forward_walk_ops(x)
        return {"out": out, "before": before, "logits": logits}

    values = run_graph(build, {"x": X, "raw": RAW})
    np.testing.assert_allclose(values["before"], model_np(X), rtol=1e-5)
    preprocessed = RAW.astype(np.float32) / 255.0 - MEAN
    np.testing.assert_allclose(values["logits"], model_np(preprocessed), rtol=1e-5)
    np.testing.assert_allclose(values["out"], 2.0 * softmax_np(model_np(preprocessed)), rtol=1e-5)


def test_insert_and_bypass_an_op(run_graph):
    def build(graph, inputs):
        x = inputs["x"]
        h1 = tf.multiply(x, 10.0, name="h1")
        noisy = tf.add(h1, 1000.0, name="noisy")  # an op to bypass
        h2 = tf.square(noisy, name="h2")
        # Bypass: readers of noisy read its input instead.
        assert ge.reroute_ts(h1, noisy) == 1
        assert OpMatcher("h2").input_ops("h1")(h2.op)
        # Insert a clip between h1 and its readers (but not the clip itself).
        clipped = tf.clip_by_value(h1, -5.0, 5.0, name="clip")
        clip_ops = ge.get_backward_walk_ops(clipped, stop_at_ts=[h1])
        assert ge.reroute_ts(clipped, h1, cannot_modify=clip_ops) == 2  # h2, noisy
        assert OpMatcher("h2").input_ops("clip")(h2.op)
        return h2

    np.testing.assert_allclose(run_graph(build, {"x": X}), np.clip(10.0 * X, -5.0, 5.0) ** 2)


def test_graft_keeps_gradients_right(run_graph):
    """After the graft, tf.gradients differentiates through the new subgraphs."""

    def build(graph, inputs):
        x, z = inputs["x"], inputs["z"]
        logits, out = build_model(x)
        pre = tf.multiply(z, 2.0, name="pre")
        assert ge.reroute_ts(pre, x, can_modify=ge.get_name_scope_ops(graph, "model")) == 1
        loss = tf.reduce_sum(out)
        (dz,) = tf.gradients(loss, [z])
        (dx,) = tf.gradients(loss, [x])
        assert dx is None  # x no longer reaches the loss
        return dz

    dz = run_graph(build, {"x": X, "z": X})
    # d/dz sum(3 tanh(2z W + B)) = 2 * (3 (1 - tanh^2) @ W^T)
    t = np.tanh((2.0 * X) @ W + B)
    np.testing.assert_allclose(dz, 2.0 * (3.0 * (1 - t ** 2)) @ W.T, rtol=1e-4, atol=1e-5)

