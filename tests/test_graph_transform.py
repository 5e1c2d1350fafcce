"""copy_with_input_replacements and CopyResult, in both graph kinds."""

import numpy as np
import pytest
import tensorflow as tf

from memsave import graph as ge
from memsave.graph import OpMatcher

X = np.array([[1.0, 2.0], [3.0, -4.0]], np.float32)
W = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)


def build_net(x):
    """x -> h = tanh(x @ W^T) -> y = sum(h * x) (keepdims), returns the tensors."""
    w = tf.constant(W, name="w")
    mm = tf.matmul(x, w, transpose_b=True, name="mm")
    h = tf.tanh(mm, name="h")
    hx = tf.multiply(h, x, name="hx")
    y = tf.reduce_sum(hx, axis=1, keepdims=True, name="y")
    return {"w": w, "mm": mm, "h": h, "hx": hx, "y": y}


def expected_y(x):
    return np.sum(np.tanh(x @ W.T) * x, axis=1, keepdims=True)


def test_copy_computes_same_values_and_maps_both_ways(run_graph):
    def build(graph, inputs):
        x = inputs["x"]
        t = build_net(x)
        ops = [t[k].op for k in ("mm", "h", "hx", "y")]
        before = len(graph.get_operations())
        result = ge.copy_with_input_replacements(ops)
        assert len(result) == 4 and len(graph.get_operations()) == before + 4
        for op in ops:
            copy = result.transformed(op)
            assert copy is not None and copy is not op
            assert copy.type == op.type
            assert result.original(copy) is op
            assert result.transformed(result.original(copy)) is copy
            for out, copied_out in zip(op.outputs, copy.outputs):
                assert result.transformed(out) is copied_out
                assert result.original(copied_out) is out
                assert copied_out.shape == out.shape
                assert copied_out.dtype == out.dtype
        # Ops that were not copied map to None, both ways.
        assert result.transformed(t["w"]) is None and result.original(t["w"]) is None
        assert result.original(t["y"]) is None
        # Inside the set, copies read copies; outside it, the original tensors.
        y_copy = result.transformed(t["y"])
        assert y_copy.op.name.startswith("copy/")
        assert OpMatcher(y_copy).input_ops(result.transformed(t["hx"]), ".*")(y_copy.op)
        mm_copy = result.transformed(t["mm"])
        assert OpMatcher(mm_copy).input_ops(x, t["w"])(mm_copy.op)
        # The ops are created in topological order.
        assert result.ops == [result.transformed(op) for op in ops]
        # Attributes survive.
        assert mm_copy.op.get_attr("transpose_b") is True
        assert y_copy.op.get_attr("keep_dims") is True
        # The originals are untouched.
        assert OpMatcher("y").input_ops("hx", ".*")(t["y"].op)
        return {"y": t["y"], "y_copy": y_copy}

    values = run_graph(build, {"x": X})
    np.testing.assert_allclose(values["y"], expected_y(X), rtol=1e-6)
    np.testing.assert_allclose(values["y_copy"], values["y"], rtol=1e-6)


def test_replacements_feed_the_copies(run_graph):
    def build(graph, inputs):
        x, z = inputs["x"], inputs["z"]
        t = build_net(x)
        ops = ge.get_backward_walk_ops(t["y"], stop_at_ts=[x, t["w"]], inclusive=True)
        # (names as TensorFlow gave them: how it uniquifies them differs between versions)
        expected = [t[k].op for k in ("mm", "h", "hx", "y")] + [t["y"].op.inputs[1].op]
        assert sorted(op.name for op in ops) == sorted(op.name for op in expected)
        w2 = tf.constant(2.0 * W, name="w2")
        result = ge.copy_with_input_replacements(ops, [(x, z), (t["w"], w2)], name_scope="again")
        y2 = result.transformed(t["y"])
        assert y2.op.name == "again/" + t["y"].op.name
        # A TensorMap works as replacements too.
        result2 = ge.copy_with_input_replacements(ops, ge.TensorMap([(x, z)]))
        # A replacement for a tensor produced inside the set does not override the copy.
        result3 = ge.copy_with_input_replacements(ops, [(t["h"], tf.zeros_like(t["h"]))])
        return {"y2": y2, "y3": result2.transformed(t["y"]), "y4": result3.transformed(t["y"])}

    z = X[::-1].copy()
    values = run_graph(build, {"x": X, "z": z})
    expected = np.sum(np.tanh(z @ (2.0 * W).T) * z, axis=1, keepdims=True)
    np.testing.assert_allclose(values["y2"], expected, rtol=1e-6)
    np.testing.assert_allclose(values["y3"], expected_y(z), rtol=1e-6)
    np.testing.assert_allclose(values["y4"], expected_y(X), rtol=1e-6)


def test_copy_keeps_device_colocation_and_control_inputs(run_graph):
    def build(graph, inputs):
        x = inputs["x"]
        anchor = tf.identity(x, name="anchor")
        with tf.device("/device:CPU:0"):
            a = tf.multiply(x, 2.0, name="a")
        with tf.compat.v1.colocate_with(anchor.op):
            b = tf.add(a, 1.0, name="b")
        with tf.control_dependencies([a.op, anchor.op]):
            c = tf.multiply(b, b, name="c")
        # a is not a direct input of c (b is), so it stays a control input.
        assert c.op.control_inputs == [a.op, anchor.op]
        result = ge.copy_with_input_replacements([a.op, b.op, c.op])
        a2, b2, c2 = (result.transformed(t) for t in (a, b, c))
        assert a2.op.device == a.op.device and "CPU:0" in a2.op.device
        assert b2.op.colocation_groups() == b.op.colocation_groups() == [b"loc:@anchor"]
        # Control inputs on copied ops go to the copies; others stay.
        assert c2.op.control_inputs == [a2.op, anchor.op]
        result2 = ge.copy_with_input_replacements([c.op], copy_control_inputs=False)
        assert result2.transformed(c).op.control_inputs == []
        return c2

    np.testing.assert_allclose(run_graph(build, {"x": X}), (2.0 * X + 1.0) ** 2)


def test_copied_control_input_maps_to_copy(run_graph):
    def build(graph, inputs):
        x = inputs["x"]
        a = tf.multiply(x, 2.0, name="a")
        unrelated = tf.add(x, 1.0, name="unrelated")
        with tf.control_dependencies([unrelated.op]):
            b = tf.add(a, x, name="b")
        assert b.op.control_inputs == [unrelated.op]
        result = ge.copy_with_input_replacements([unrelated.op, a.op, b.op])
        b2 = result.transformed(b)
        assert b2.op.control_inputs == [result.transformed(unrelated).op]
        return b2

    np.testing.assert_allclose(run_graph(build, {"x": X}), 3.0 * X)


def test_gradients_flow_through_copies(run_graph):
    def build(graph, inputs):
        x = inputs["x"]
        t = build_net(x)
        ops = ge.get_backward_walk_ops(t["y"], stop_at_ts=[x, t["w"]])
        result = ge.copy_with_input_replacements(ops)
        (grad,) = tf.gradients(t["y"], [x])
        (grad_copy,) = tf.gradients(result.transformed(t["y"]), [x])
        return {"grad": grad, "grad_copy": grad_copy}

    values = run_graph(build, {"x": X})
    np.testing.assert_allclose(values["grad_copy"], values["grad"], rtol=1e-6)
    # d/dx sum(tanh(x W^T) * x) = tanh(x W^T) + (1 - tanh^2(x W^T) * x) @ W  (row-wise)
    h = np.tanh(X @ W.T)
    np.testing.assert_allclose(values["grad"], h + ((1 - h ** 2) * X) @ W, rtol=1e-5)


def test_copy_keeps_custom_gradient(run_graph):
    @tf.custom_gradient
    def scaled_identity(v):
        def grad(dy):
            return 100.0 * dy
        return tf.identity(v), grad

    def build(graph, inputs):
        x = inputs["x"]
        y = tf.reduce_sum(scaled_identity(x) * 1.0, name="y")
        ops = ge.get_backward_walk_ops(y, stop_at_ts=[x])
        result = ge.copy_with_input_replacements(ops)
        (grad,) = tf.gradients(result.transformed(y), [x])
        return grad

    np.testing.assert_allclose(run_graph(build, {"x": X}), np.full_like(X, 100.0))


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_bad_replacement_raises_and_creates_nothing(run_graph, bad):
    def build(graph, inputs):
        x = inputs["x"]
        t = build_net(x)
        wrong = tf.ones([2, 2], tf.int32) if bad == "dtype" else tf.ones([3, 2])
        before = len(graph.get_operations())
        with pytest.raises(ValueError, match="dtypes differ" if bad == "dtype" else "shapes"):
            ge.copy_with_input_replacements([t["mm"].op, t["h"].op], [(x, wrong)])
        assert len(graph.get_operations()) == before
        return t["y"]

    np.testing.assert_allclose(run_graph(build, {"x": X}), expected_y(X), rtol=1e-6)


def test_copy_of_nothing_and_of_tensors(run_graph):
    def build(graph, inputs):
        t = build_net(inputs["x"])
        assert len(ge.copy_with_input_replacements([])) == 0
        result = ge.copy_with_input_replacements(t["h"])  # a tensor stands for its op
        assert [op.type for op in result.ops] == ["Tanh"]
        return result.transformed(t["h"])

    np.testing.assert_allclose(run_graph(build, {"x": X}), np.tanh(X @ W.T), rtol=1e-6)
