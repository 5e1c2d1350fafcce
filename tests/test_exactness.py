"""Every gradient function is called once, with its whole incoming gradient (issue 26).

tf.gradients calls each op's gradient function once, with the sum of the gradients
reaching the op. A gradient that is not linear in that sum (clipping) is wrong when
called once per part and added: clip(a) + clip(b) != clip(a + b). These graphs put
such an op in front of both a recomputed segment and an op memsave keeps whole (a
cond, a while loop, a stateful op), in float64, and count the calls.

The memory model builds each custom gradient once in a scratch graph that is never
run (memsave.planner.custom_gradients); calls made there are counted apart.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave

from _gradcheck import assert_same_gradients, clipped_square, evaluate

KINDS = ["v1", "function"]
X = np.linspace(0.3, 1.2, 6).reshape(2, 3)
STRATEGIES = ["list", "memory", "speed", "budget"]


class Calls:
    """Counts a gradient function's calls by the graph they build into, telling the
    memory model's scratch probes (memsave_probe_*) apart."""

    def __init__(self):
        self.graphs = []

    def record(self, dy):
        self.graphs.append(dy.graph)

    def in_step(self):
        return sum(1 for g in self.graphs if not getattr(g, "name", "").startswith("memsave_probe"))

    def probes(self):
        return len(self.graphs) - self.in_step()


def _clipped_square(calls):
    return clipped_square(calls.record, 3.0)


def _kept(kind, t, x):
    """An op memsave keeps whole, reading t."""
    if kind == "cond":
        return tf.compat.v1.cond(x[0, 0] > -100.0, lambda: t * 2.0, lambda: t * 3.0)
    if kind == "while":
        return tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a * 2.0), [0, t])[1]
    if kind == "stateful":  # Print is stateful, and passes its gradient through
        return tf.compat.v1.Print(t, [tf.reduce_sum(t)], message="memsave test: ") * 2.0
    raise ValueError(kind)


def _checkpoints(strategy, u):
    return {"list": [u], "memory": "memory", "speed": "speed",
            "budget": memsave.budget(0.99)}[strategy]


def _clipping_step(graph_kind, kept_kind, strategy):
    """(tf.gradients' value, memsave's, calls by tf.gradients, calls by memsave)."""
    counts = {}

    def body(graph, inputs):
        x = inputs["x"]
        calls = Calls()
        t = _clipped_square(calls)(x)
        w = tf.constant(np.linspace(-1.0, 1.0, 9).reshape(3, 3))
        u = tf.tanh(tf.matmul(t, w), name="u")  # a checkpoint ('speed': the matmul): t
        # feeds a recomputed segment...
        h = _kept(kept_kind, t, x)  # ...and an op memsave keeps whole
        y = tf.reduce_sum(u) + tf.reduce_sum(h)
        reference = tf.compat.v1.gradients(y, x)
        counts["tf"] = calls.in_step()
        with memsave.always_rewrite():
            got = memsave.gradients(y, x, checkpoints=_checkpoints(strategy, u))
        counts["memsave"] = calls.in_step() - counts["tf"]
        counts["probes"] = calls.probes()
        counts["rewritten"] = memsave.last_report().fallback is None
        return reference + got

    expected, got = evaluate(graph_kind, body, {"x": X})
    return expected, got, counts


@pytest.mark.parametrize("graph_kind", KINDS)
@pytest.mark.parametrize("kept_kind", ["cond", "while", "stateful"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_clipping_custom_gradient_is_called_once_with_its_whole_gradient(
        graph_kind, kept_kind, strategy):
    expected, got, counts = _clipping_step(graph_kind, kept_kind, strategy)
    assert counts["rewritten"], "the rewrite was not built"
    assert counts["tf"] == 1
    assert counts["memsave"] == counts["tf"], counts
    assert counts["probes"] <= 1, counts
    # The clip bites: the two parts of the gradient give a value 35% off.
    assert_same_gradients([expected], [got], rtol=1e-12, label=f"{graph_kind}/{kept_kind}")


@tf.RegisterGradient("MemsaveTestClippedSquare")
def _clipped_square_gradient(op, dy):
    _OVERRIDE_CALLS.record(dy)
    return tf.clip_by_value(dy * 2.0 * op.inputs[0], -3.0, 3.0)


_OVERRIDE_CALLS = Calls()


@pytest.mark.parametrize("graph_kind", KINDS)
@pytest.mark.parametrize("kept_kind", ["cond", "while"])
def test_an_overridden_registered_gradient_is_called_once(graph_kind, kept_kind):
    _OVERRIDE_CALLS.graphs.clear()

    def body(graph, inputs):
        x = inputs["x"]
        with graph.gradient_override_map({"Square": "MemsaveTestClippedSquare"}):
            t = tf.square(x)
        u = tf.tanh(t)
        y = tf.reduce_sum(u) + tf.reduce_sum(_kept(kept_kind, t, x))
        reference = tf.compat.v1.gradients(y, x)
        before = _OVERRIDE_CALLS.in_step()
        with memsave.always_rewrite():
            got = memsave.gradients(y, x, checkpoints=[u])
        assert _OVERRIDE_CALLS.in_step() - before == before == 1
        return reference + got

    expected, got = evaluate(graph_kind, body, {"x": X})
    assert_same_gradients([expected], [got], rtol=1e-12)


def test_inputs_of_kept_ops_become_checkpoints_with_their_reason():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [2, 3])
        t = tf.sin(x, name="t")
        u = tf.tanh(t, name="u")
        h = _kept("cond", t, x)
        y = tf.reduce_sum(u) + tf.reduce_sum(h)
        report = memsave.plan(y, x, checkpoints=[u])
    reasons = {c.name: c.reason for c in report.checkpoints}
    assert "t:0" in reasons, reasons
    assert "not recomputed" in reasons["t:0"], reasons


def test_a_kept_op_reading_a_y_whose_result_feeds_another_y():
    """ys a and b = f(cond(a), a): a is read by a kept op and by recomputed ops, so a
    segment ends at it (its gradient: its own 1 plus what comes back from b)."""
    def body(graph, inputs):
        x = inputs["x"]
        calls = Calls()
        t = _clipped_square(calls)(x)
        a = tf.tanh(t, name="a")
        h = _kept("cond", a, x)
        b = tf.sin(h) * a
        reference = tf.compat.v1.gradients([a, b], x)
        with memsave.always_rewrite():
            got = memsave.gradients([a, b], x, checkpoints=[t])
        report = memsave.last_report()
        assert report.fallback is None, report.fallback
        reasons = {c.name: c.reason for c in report.checkpoints}
        assert "one of the ys" in reasons["a:0"], reasons
        assert calls.in_step() == 2
        return reference + got

    expected, got = evaluate("v1", body, {"x": X})
    assert_same_gradients([expected], [got], rtol=1e-12)


@pytest.mark.parametrize("graph_kind", KINDS)
def test_a_y_read_by_a_later_segment_is_differentiated_once(graph_kind):
    """ys [t, conv(t)] with t a clipping custom gradient's output and the convolution a
    checkpoint ('speed'): t's op was copied by both segments (found by benchmarks/fuzz.py,
    seed 1090)."""
    def body(graph, inputs):
        x = inputs["x"]
        calls = Calls()
        t = _clipped_square(calls)(tf.sin(x))
        image = tf.reshape(t, [2, 3, 1, 1])
        conv = tf.reshape(tf.nn.conv2d(image, tf.constant([[[[0.7]]]], tf.float64), 1, "SAME"),
                          [2, 3])
        ys = [t, conv * conv]
        reference = tf.compat.v1.gradients(ys, x)
        with memsave.always_rewrite():
            got = memsave.gradients(ys, x, checkpoints="speed")
        assert memsave.last_report().fallback is None
        assert calls.in_step() == 2, calls.in_step()
        return reference + got

    expected, got = evaluate(graph_kind, body, {"x": X})
    assert_same_gradients([expected], [got], rtol=1e-12)


@pytest.mark.parametrize("graph_kind", KINDS)
@pytest.mark.parametrize("strategy", ["tanh", "matmul and tanh", "memory"])
def test_a_split_with_one_output_a_y_and_the_other_read_by_a_segment(graph_kind, strategy):
    """ys [a, f(b)] with a, b = split(h) and f's tanh a checkpoint: the split is needed by
    the last segment (for a) and by the checkpoint's segment (for b), so both its outputs
    are kept and it heads a segment of its own, differentiated once with both gradients
    (the builder copying the planner's segments crashed here: benchmarks/fuzz.py, seed
    5047 and nine more of 5000..5999, under 'memory', which kept the tanh and the
    matmul: listed here, as 'memory' may keep other tensors, and 'memory' runs too)."""
    def body(graph, inputs):
        x = inputs["x"]
        w = tf.constant(np.linspace(-0.5, 0.8, 9).reshape(3, 3))
        product = tf.matmul(x, w)
        h = tf.tanh(product)
        a, b = tf.split(h, [1, 2], axis=1)
        c = tf.tanh(b * 1.5)
        ys = [a, tf.reduce_sum(tf.sin(c) * c)]
        reference = tf.compat.v1.gradients(ys, [x, w])
        listed = {"tanh": [c], "matmul and tanh": [product, c]}.get(strategy, strategy)
        with memsave.always_rewrite():
            got = memsave.gradients(ys, [x, w], checkpoints=listed)
        report = memsave.last_report()
        assert report.fallback is None, report.fallback
        if strategy != "memory":
            assert a.name in [info.name for info in report.checkpoints]
        return reference + got

    values = evaluate(graph_kind, body, {"x": X})
    assert_same_gradients(values[:2], values[2:], rtol=1e-12)


def test_an_x_computed_from_other_xs_under_the_ordered_backward_pass():
    """xs [x0, c - (c - x0)] with a stateful embedding lookup after them; 'memory' orders
    its large gradient ops (control inputs). A control input added to a Neg from the op
    whose output it reads made Grappler's arithmetic optimizer give x0 the opposite
    sign (benchmarks/fuzz.py, seed 9763): such redundant control inputs are not added."""
    def body(graph, inputs):
        x0 = inputs["x"]
        c = tf.constant(np.linspace(0.1, 0.9, 6).reshape(2, 3))
        sub = c - x0
        sub_1 = c - sub
        table = tf.Variable(np.linspace(-1.0, 1.0, 30).reshape(10, 3))
        mul_2 = tf.nn.embedding_lookup(table, tf.constant([1, 3])) * sub_1
        ys = [tf.reduce_sum(c), tf.reduce_sum(mul_2 * 1.1)]
        grad_ys = [tf.constant(0.7, tf.float64), tf.constant(1.3, tf.float64)]
        reference = tf.compat.v1.gradients(ys, [x0, sub_1], grad_ys=grad_ys)
        with memsave.always_rewrite():
            got = memsave.gradients(ys, [x0, sub_1], grad_ys=grad_ys, checkpoints="memory")
        assert memsave.last_report().orders_backward
        return reference + got

    values = evaluate("v1", body, {"x": X})
    assert_same_gradients(values[:2], values[2:], rtol=1e-12)
