"""reroute_ts / swap_ts on twin graphs `a0,b0 -> c0` and `a1,b1 -> c1`, in both graph kinds."""

import numpy as np
import pytest
import tensorflow as tf

from memsave import graph as ge
from memsave.graph import OpMatcher


def build_twins():
    t = {
        "a0": tf.constant([1.0, 2.0], name="a0"),
        "b0": tf.constant([10.0, 20.0], name="b0"),
        "a1": tf.constant([100.0, 200.0], name="a1"),
        "b1": tf.constant([1000.0, 2000.0], name="b1"),
    }
    t["c0"] = tf.add(t["a0"], t["b0"], name="c0")
    t["c1"] = tf.add(t["a1"], t["b1"], name="c1")
    return t


def reads(t, name, *inputs):
    return OpMatcher(name).input_ops(*inputs)(t[name].op)


def test_reroute_and_back(run_graph):
    def build(graph, _):
        t = build_twins()
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a1", "b1")
        moved = ge.reroute_ts([t["a0"], t["b0"]], [t["a1"], t["b1"]])
        assert moved == 2
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a0", "b0")
        assert not reads(t, "c1", "a1", "b1")
        # a1 and b1 have no readers left.
        assert t["a1"].consumers() == [] and t["b1"].consumers() == []
        # Back again: only c1 goes back to a1, b1.
        moved = ge.reroute_ts([t["a1"], t["b1"]], [t["a0"], t["b0"]], can_modify=[t["c1"].op])
        assert moved == 2
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a1", "b1")
        return {"c0": t["c0"], "c1": t["c1"]}

    values = run_graph(build)
    np.testing.assert_allclose(values["c0"], [11.0, 22.0])
    np.testing.assert_allclose(values["c1"], [1100.0, 2200.0])


def test_reroute_moves_every_reader(run_graph):
    def build(graph, _):
        t = build_twins()
        ge.reroute_ts([t["a0"], t["b0"]], [t["a1"], t["b1"]])
        # Now a0, b0 have two readers each; rerouting them moves all four edges.
        moved = ge.reroute_ts([t["a1"], t["b1"]], [t["a0"], t["b0"]])
        assert moved == 4
        assert reads(t, "c0", "a1", "b1") and reads(t, "c1", "a1", "b1")
        return [t["c0"], t["c1"]]

    c0, c1 = run_graph(build)
    np.testing.assert_allclose(c0, [1100.0, 2200.0])
    np.testing.assert_allclose(c1, [1100.0, 2200.0])


def test_can_modify_and_cannot_modify(run_graph):
    def build(graph, _):
        t = build_twins()
        d = tf.multiply(t["a0"], 2.0, name="d")
        # Only c0 may change: d keeps reading a0.
        assert ge.reroute_ts(t["a1"], t["a0"], can_modify=[t["c0"].op]) == 1
        assert reads(t, "c0", "a1", "b0") and OpMatcher("d").input_ops("a0", ".*")(d.op)
        # Tensors stand for their producers, and sets are accepted.
        assert ge.reroute_ts(t["a0"], t["a1"], can_modify={t["c0"].op}, cannot_modify=[t["c0"]]) == 0
        assert ge.reroute_ts(t["a0"], t["a1"], cannot_modify=[t["c1"]]) == 1
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a1", "b1")
        return [t["c0"], d]

    c0, d = run_graph(build)
    np.testing.assert_allclose(c0, [11.0, 22.0])
    np.testing.assert_allclose(d, [2.0, 4.0])


def test_swap(run_graph):
    def build(graph, _):
        t = build_twins()
        moved = ge.swap_ts([t["a0"], t["b0"]], [t["a1"], t["b1"]])
        assert moved == 4
        assert reads(t, "c0", "a1", "b1") and reads(t, "c1", "a0", "b0")
        # Swapping two inputs of the same op exchanges them instead of collapsing them.
        assert ge.swap_ts([t["a0"]], [t["b0"]]) == 2
        assert reads(t, "c1", "b0", "a0")
        # Swap restricted to c0 only.
        assert ge.swap_ts([t["a0"], t["b0"]], [t["a1"], t["b1"]], can_modify=[t["c0"].op]) == 2
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "b0", "a0")
        return [t["c0"], t["c1"]]

    c0, c1 = run_graph(build)
    np.testing.assert_allclose(c0, [11.0, 22.0])
    np.testing.assert_allclose(c1, [11.0, 22.0])


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_incompatible_reroute_raises_and_changes_nothing(run_graph, bad):
    def build(graph, _):
        t = build_twins()
        if bad == "dtype":
            other = tf.constant([1, 2], name="ints")
        else:
            other = tf.constant([1.0, 2.0, 3.0], name="three")
        # The first pair is fine, the second is not: nothing may move at all.
        with pytest.raises(ValueError, match="dtypes differ" if bad == "dtype" else "shapes"):
            ge.reroute_ts([t["a1"], other], [t["a0"], t["b0"]])
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a1", "b1")
        with pytest.raises(ValueError):
            ge.swap_ts([t["a1"], other], [t["a0"], t["b0"]])
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a1", "b1")
        return t["c0"]

    np.testing.assert_allclose(run_graph(build), [11.0, 22.0])


def test_unknown_shapes_are_compatible(graph_kind):
    def build(anything):
        t = build_twins()
        assert anything.shape.rank is None
        assert ge.reroute_ts(anything, t["a0"]) == 1
        assert reads(t, "c0", "anything", "b0")
        return t["c0"]

    feed = np.array([5.0, 6.0], np.float32)
    if graph_kind == "v1":
        with tf.Graph().as_default():
            anything = tf.compat.v1.placeholder(tf.float32, shape=None, name="anything")
            c0 = build(anything)
            with tf.compat.v1.Session() as session:
                value = session.run(c0, {anything: feed})
    else:
        spec = tf.TensorSpec(None, tf.float32, name="anything")
        value = tf.function(build, autograph=False, input_signature=[spec])(feed).numpy()
    np.testing.assert_allclose(value, [15.0, 26.0])


def test_bad_arguments_raise_and_change_nothing(run_graph):
    def build(graph, _):
        t = build_twins()
        with pytest.raises(ValueError, match="same length"):
            ge.reroute_ts([t["a1"], t["b1"]], [t["a0"]])
        with pytest.raises(ValueError, match="twice"):
            ge.reroute_ts([t["a1"], t["b1"]], [t["a0"], t["a0"]])
        with pytest.raises(TypeError):
            ge.reroute_ts(t["a1"].op, t["a0"])
        assert reads(t, "c0", "a0", "b0") and reads(t, "c1", "a1", "b1")
        # The same source may feed several targets.
        assert ge.reroute_ts([t["a1"], t["a1"]], [t["a0"], t["b0"]]) == 2
        assert reads(t, "c0", "a1", "a1")
        return t["c0"]

    np.testing.assert_allclose(run_graph(build), [200.0, 400.0])


def test_op_reading_a_tensor_twice_counts_both_edges(run_graph):
    def build(graph, _):
        a = tf.constant(3.0, name="a")
        b = tf.constant(4.0, name="b")
        sq = tf.multiply(a, a, name="sq")
        assert ge.reroute_ts(b, a) == 2
        assert OpMatcher("sq").input_ops("b", "b")(sq.op)
        return sq

    assert run_graph(build) == pytest.approx(16.0)


def test_reroute_refuses_to_make_a_cycle(run_graph):
    def build(graph, _):
        x = tf.constant([1.0, 2.0], name="x")
        y = tf.multiply(x, 3.0, name="y")
        sg = tf.stop_gradient(x, name="sg")
        post = tf.add(y, 1.0, name="post")
        post2 = tf.multiply(post, 2.0, name="post2")
        # sg reads x itself: rerouting all readers of x onto sg would loop.
        with pytest.raises(ValueError, match="cycle"):
            ge.reroute_ts(sg, x)
        # post2 depends on y through post: an indirect cycle.
        with pytest.raises(ValueError, match="cycle"):
            ge.reroute_ts(post2, y)
        assert OpMatcher("y").input_ops("x", ".*")(y.op)
        assert OpMatcher("post").input_ops("y", ".*")(post.op)
        # Leaving the offending ops out is fine.
        assert ge.reroute_ts(sg, x, cannot_modify=[sg]) == 1
        assert OpMatcher("y").input_ops("sg", ".*")(y.op)
        return post2

    np.testing.assert_allclose(run_graph(build), [8.0, 14.0])
