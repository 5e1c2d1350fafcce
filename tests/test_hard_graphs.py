"""Graphs real models produce: memsave must give exactly tf.gradients's gradients.

Every case is built once per graph kind (a tf.compat.v1 Graph run in a Session,
a tf.function body, and, for control flow, a v1 graph with v1 control flow);
tf.gradients and memsave.gradients with each strategy ('memory', 'speed',
'collection', explicit lists) are taken in the same graph and evaluated in one
run, so random ops draw once and every gradient sees the same forward pass
(see _gradcheck.compare_strategies). No recomputed copy may be a stateful op.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.measure import run_isolated

from _gradcheck import (Case, assert_same_gradients, compare_strategies, evaluate,
                        stateful_copies, variable_store)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
KINDS = ["v1", "function"]
RNG = np.random.RandomState(0)
X = RNG.standard_normal([8, 6]).astype(np.float32)
W_VALUES = [(RNG.standard_normal([6, 6]) / np.sqrt(6)).astype(np.float32) for _ in range(3)]


def _weights():
    return [tf.constant(w) for w in W_VALUES]


@pytest.fixture
def v1_control_flow():
    """tf.compat.v1 control flow (Switch/Merge/Enter/Exit) for graphs built in the test."""
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    tf.compat.v1.disable_control_flow_v2()
    yield
    if was_v2:
        tf.compat.v1.enable_control_flow_v2()


# -- randomness ------------------------------------------------------------------------

def _random_model(inputs):
    x = inputs["x"]
    w1, w2, _ = _weights()
    h1 = tf.tanh(tf.matmul(x, w1))
    h2 = tf.nn.dropout(h1, rate=0.5)                        # RandomUniform (stateful)
    h3 = tf.sin(h2) * tf.random.normal(tf.shape(h2))        # its shape depends on x
    h4 = h3 + 0.1 * tf.random.stateless_normal(tf.shape(h3), seed=[1, 2])
    h5 = tf.nn.dropout(tf.tanh(tf.matmul(h4, w2)), rate=0.3)
    y = tf.reduce_sum(h5 * h5)
    return Case([y], [x, w1, w2], lists=[[h1], [h3], [h2, h4], [h1, h3, h5]], marks=[h1, h4],
                fetch={"dropped": h2})


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_and_random_ops_are_not_redrawn(kind):
    values, _ = compare_strategies(kind, _random_model, {"x": X})
    # The graph really is random: dropout zeroed some units.
    assert np.any(values["extra"]["dropped"] == 0.0)


# -- batch norm and other stateful ops --------------------------------------------------

def _batch_norm_v1(x, moving_mean, moving_var):
    """A hand-written training-mode batch norm updating its moving statistics."""
    mean, var = tf.nn.moments(x, [0])
    updates = [moving_mean.assign(0.9 * moving_mean + 0.1 * mean),
               moving_var.assign(0.9 * moving_var + 0.1 * var)]
    with tf.control_dependencies(updates):
        return (x - mean) * tf.math.rsqrt(var + 1e-3)


def _batch_norm_graph(strategy):
    """One v1 graph: two batch norms (hand-written and fused); returns the moving
    statistics after one step that fetches only the chosen gradients."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 6])
        w1, w2, _ = _weights()
        moving = [tf.compat.v1.Variable(np.full([6], v, np.float32), use_resource=True,
                                        trainable=False) for v in (0.0, 1.0)]
        h = tf.matmul(x, w1)
        hn = tf.tanh(_batch_norm_v1(h, *moving))
        h2 = tf.reshape(tf.matmul(hn, w2), [2, 2, 2, 6])
        fused, batch_mean, _ = tf.compat.v1.nn.fused_batch_norm(
            h2, tf.ones([6]), tf.zeros([6]), is_training=True)[:3]
        y = tf.reduce_sum(tf.sin(fused)) + tf.reduce_sum(batch_mean * batch_mean)
        if strategy == "plain":
            grads = tf.gradients(y, [x, w1, w2])
        else:
            memsave.mark_checkpoint(hn)
            checkpoints = [hn, h2] if strategy == "list" else strategy
            before = len(graph.get_operations())
            grads = memsave.gradients(y, [x, w1, w2], checkpoints=checkpoints)
            assert not stateful_copies(graph.get_operations()[before:])
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            grad_values = session.run(grads, {x: X})
            return grad_values, session.run(moving)


@pytest.mark.parametrize("strategy", ["memory", "speed", "collection", "list"])
def test_v1_batch_norm_updates_moving_statistics_once(strategy):
    expected_grads, expected_moving = _batch_norm_graph("plain")
    grads, moving = _batch_norm_graph(strategy)
    for e, g in zip(expected_moving, moving):
        np.testing.assert_array_equal(g, e)
    for e, g in zip(expected_grads, grads):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6 * np.max(np.abs(e)))


def _keras_step(strategy):
    """One training step of a small Keras model with BatchNormalization and Dropout
    (training=True) in tf.function; returns (memsave or plain gradients, the
    reference gradients of the same step, the moving statistics after the step)."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(16), keras.layers.BatchNormalization(),
              keras.layers.Activation("tanh"), keras.layers.Dense(16),
              keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
              keras.layers.Activation("relu"), keras.layers.Dense(1)]
    model = keras.Sequential([keras.Input((6,))] + layers)
    variables = model.trainable_variables

    @tf.function
    def step(x):
        outputs, h = [], x
        for layer in layers:
            h = layer(h, training=True)
            outputs.append(h)
        loss = tf.reduce_mean(h * h)
        reference = tf.gradients(loss, variables)
        if strategy == "plain":
            return reference, reference
        memsave.mark_checkpoint(outputs[2])
        memsave.mark_checkpoint(outputs[5])
        checkpoints = [outputs[0], outputs[3], outputs[6]] if strategy == "list" else strategy
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        grads = memsave.gradients(loss, variables, checkpoints=checkpoints)
        assert not stateful_copies(graph.get_operations()[before:])
        return grads, reference

    grads, reference = step(tf.constant(X))
    return ([g.numpy() for g in grads], [g.numpy() for g in reference],
            [v.numpy() for v in model.non_trainable_variables])


@pytest.mark.parametrize("strategy", ["memory", "speed", "collection", "list"])
def test_keras_batch_norm_and_dropout_in_tf_function(strategy):
    _, plain_grads, plain_moving = _keras_step("plain")
    grads, reference, moving = _keras_step(strategy)
    assert_same_gradients(reference, grads, label=strategy)
    # Moving statistics (and the dropout seed generator's state) were updated
    # exactly once, as without memsave.
    assert len(moving) == 5
    for e, g in zip(plain_moving, moving):
        np.testing.assert_array_equal(g, e)
    assert all(np.all((m != 0.0) & (m != 1.0)) for m in moving[:4])
    # Same seeds, same step: the plain step's gradients are the same too.
    assert_same_gradients(plain_grads, grads, label=strategy)


def _stateful_model(print_file, queue=False):
    variable = variable_store()

    def build(inputs):
        x = inputs["x"]
        w1, w2, _ = _weights()
        counter = variable("counter", lambda: tf.Variable(0.0, trainable=False))
        h = tf.tanh(tf.matmul(x, w1))
        effects = [counter.assign_add(1.0),
                   tf.print("sum", tf.reduce_sum(h), output_stream=f"file://{print_file}")]
        if queue:
            fifo = tf.queue.FIFOQueue(10, [tf.float32], shapes=[[8, 6]])
            effects.append(fifo.enqueue([h]))
        with tf.control_dependencies(effects):
            h2 = tf.sin(h) * h
        h3 = tf.tanh(tf.matmul(h2, w2))
        y = tf.reduce_sum(h3 * h)
        cases = Case([y], [x, w1, w2], lists=[[h], [h2], [h, h3]], marks=[h2])
        # Read after everything else has run: the step's effects happened once.
        return cases._replace(fetch={"counter": _read_after(counter.read_value, y),
                                     "queue": _read_after(fifo.size, y) if queue else tf.constant(1)})
    return build


def _read_after(read, t):
    with tf.control_dependencies([t.op]):
        return read()


@pytest.mark.parametrize("kind", KINDS)
def test_stateful_ops_are_never_copied(kind, tmp_path):
    print_file = tmp_path / "printed.txt"
    values, _ = compare_strategies(kind, _stateful_model(print_file, queue=(kind == "v1")),
                                   {"x": X})
    # Each effect ran once in the one run, although 6 gradient computations read it.
    assert values["extra"]["counter"] == 1.0
    assert values["extra"]["queue"] == 1
    assert len(print_file.read_text().strip().splitlines()) == 1


# -- control flow ---------------------------------------------------------------------

def _cond_model(inputs):
    x = inputs["x"]
    w1, w2, _ = _weights()
    h = tf.tanh(tf.matmul(x, w1))
    c = tf.cond(tf.reduce_sum(h) > 0, lambda: tf.sin(h) * h * w1[0], lambda: tf.cos(h))
    h2 = tf.tanh(tf.matmul(c, w2))
    h3 = tf.sin(h2) * h
    y = tf.reduce_sum(h3 * h3)
    return Case([y], [x, w1, w2], lists=[[h], [h2], [h3], [c], [h, h3]], marks=[h, h3])


def _while_model(inputs):
    x = inputs["x"]
    w1, w2, _ = _weights()
    h = tf.tanh(tf.matmul(x, w1))
    _, looped = tf.while_loop(lambda i, s: i < 3,
                              lambda i, s: (i + 1, tf.tanh(tf.matmul(s, w2)) + s * h),
                              (tf.constant(0), h))
    h2 = tf.sin(looped) * h
    y = tf.reduce_sum(h2 * h2)
    return Case([y], [x, w1, w2], lists=[[h], [looped], [h2], [h, h2]], marks=[h, h2])


def _rnn_model(inputs):
    """An RNN over the 8 rows of x (time steps), built with tf.while_loop and TensorArrays."""
    x = inputs["x"]
    w_in, w_rec, w_out = _weights()
    projected = tf.tanh(tf.matmul(x, w_in))
    steps = tf.TensorArray(tf.float32, size=8).unstack(projected[:, None, :])

    def body(t, state, outputs):
        state = tf.tanh(tf.matmul(state, w_rec) + steps.read(t))
        return t + 1, state, outputs.write(t, state)

    _, last, outputs = tf.while_loop(
        lambda t, *_: t < 8, body,
        (tf.constant(0), tf.zeros([1, 6]), tf.TensorArray(tf.float32, size=8)))
    sequence = tf.reshape(outputs.stack(), [8, 6])
    z = tf.sin(tf.matmul(sequence, w_out))
    y = tf.reduce_sum(z * z) + tf.reduce_sum(last)
    return Case([y], [x, w_in, w_rec, w_out], lists=[[projected], [sequence], [z], [projected, z]],
                marks=[projected, z])


CONTROL_FLOW = {"cond": _cond_model, "while": _while_model, "rnn": _rnn_model}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", sorted(CONTROL_FLOW))
def test_functional_control_flow(kind, model):
    def build(inputs):
        case = CONTROL_FLOW[model](inputs)
        types = {op.type for op in case.ys[0].graph.get_operations()}
        assert types & {"If", "StatelessIf", "While", "StatelessWhile"}, types
        return case
    compare_strategies(kind, build, {"x": X})


@pytest.mark.parametrize("model", sorted(CONTROL_FLOW))
def test_v1_control_flow(model, v1_control_flow):
    def build(inputs):
        case = CONTROL_FLOW[model](inputs)
        types = {op.type for op in case.ys[0].graph.get_operations()}
        assert types & {"Switch", "Merge", "Enter", "Exit"}, types
        return case
    compare_strategies("v1", build, {"x": X})


def test_keras_lstm_in_tf_function():
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(2)
    inputs = RNG.standard_normal([4, 5, 6]).astype(np.float32)
    lstm = keras.layers.LSTM(8, return_sequences=True, dropout=0.2)
    dense = keras.layers.Dense(8, activation="tanh")
    gru = keras.layers.GRU(4)
    model = keras.Sequential([keras.Input((5, 6)), lstm, dense, gru])
    variables = model.trainable_variables

    def build(feeds):
        h1 = lstm(feeds["x"], training=True)
        h2 = dense(h1)
        y = tf.reduce_sum(gru(h2) ** 2)
        return Case([y], list(variables), lists=[[h1], [h2]], marks=[h2])
    compare_strategies("function", build, {"x": inputs})


def _keras_unet(keras, size=16, base=4, levels=3):
    """A Keras functional U-Net in float64: conv-BN-ReLU twice per level,
    Conv2DTranspose up and Concatenate skips (long skips across many segments)."""
    def block(h, filters):
        for _ in range(2):
            h = keras.layers.Conv2D(filters, 3, padding="same", dtype="float64")(h)
            h = keras.layers.BatchNormalization(dtype="float64")(h)
            h = keras.layers.ReLU(dtype="float64")(h)
        return h
    inputs = keras.Input((size, size, 3), dtype="float64")
    h, skips = inputs, []
    for level in range(levels):
        h = block(h, base * 2 ** level)
        skips.append(h)
        h = keras.layers.MaxPool2D(dtype="float64")(h)
    h = block(h, base * 2 ** levels)
    for level in reversed(range(levels)):
        h = keras.layers.Conv2DTranspose(base * 2 ** level, 2, strides=2, dtype="float64")(h)
        h = keras.layers.Concatenate(dtype="float64")([h, skips[level]])
        h = block(h, base * 2 ** level)
    return keras.Model(inputs, keras.layers.Conv2D(1, 1, dtype="float64")(h))


# The memory model's choices (reading checkpoints, recomputing ahead, ordering
# convolution gradients) depend on the kernels the machine runs: each is tried here
# whatever this machine has (None: the model of a GPU). For the suite's time, oneDNN's
# and TensorFlow's own kernels are tried with 'memory' only (orders_backward, and the
# convolution gradients ordered pairwise), a GPU's with 'speed'.
@pytest.mark.parametrize("strategy,kernels", [("speed", None), ("memory", "onednn"),
                                              ("memory", "eigen")])
def test_keras_unet_in_tf_function_is_acyclic_and_exact(strategy, kernels, monkeypatch):
    """The issue's U-Net failed with 'speed' at run time ("963 nodes in a cycle").
    The function's graph is checked after tf.function added its automatic control
    dependencies, then run."""
    keras = pytest.importorskip("keras")
    from memsave.graph.select import topological_sort
    from memsave import environment
    read = environment.Environment.read.__func__

    def with_kernels(cls, graph, *args, **kwargs):
        import dataclasses
        real = read(cls, graph, *args, **kwargs)
        return dataclasses.replace(real, kernels=kernels,
                                   conv_threads=2 if kernels == "eigen" else 0)
    monkeypatch.setattr(environment.Environment, "read", classmethod(with_kernels))
    keras.utils.set_random_seed(3)
    model = _keras_unet(keras)
    variables = model.trainable_variables

    @tf.function
    def step(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        reference = tf.gradients(loss, variables)
        with memsave.always_rewrite():
            grads = memsave.gradients(loss, variables, checkpoints=strategy)
        return grads, reference

    images = RNG.standard_normal([2, 16, 16, 3])
    concrete = step.get_concrete_function(tf.TensorSpec(images.shape, tf.float64))
    report = memsave.last_report()
    assert report.fallback is None and len(report.segments) >= 4, report.summary()
    # (The kernels took effect: TensorFlow's own convolution gradients are ordered
    # pairwise instead of chained.)
    assert report.orders_backward == (strategy == "memory" and kernels != "eigen")
    topological_sort(concrete.graph.get_operations())  # raises on a cycle
    grads, reference = concrete(tf.constant(images))
    assert_same_gradients([r.numpy() for r in reference], [g.numpy() for g in grads],
                          rtol=1e-12, label=f"{strategy}/{kernels}")


# -- sparse -------------------------------------------------------------------------------

def _embedding_model(table_kind):
    variable = variable_store()
    values = RNG.standard_normal([50, 6]).astype(np.float32)

    def build(inputs):
        if table_kind in ("variable", "read"):
            table = variable("table", lambda: tf.Variable(values))
        else:
            table = tf.identity(tf.constant(values) + inputs["x"][0, 0])
        # "read": the whole table read, then rows gathered (a Keras 3 Embedding's graph):
        # the read's gradient is the variable's, sparse.
        rows = table.value() if table_kind == "read" else table
        ids = tf.constant([1, 3, 3, 7, 49])
        w1, _, _ = _weights()
        e = tf.nn.embedding_lookup(rows, ids)
        h = tf.tanh(tf.matmul(e, w1))
        h2 = tf.sin(h) * h
        # A second lookup of the same table, deeper in the graph.
        more = tf.gather(rows, tf.cast(tf.abs(tf.reduce_sum(h2, axis=1)), tf.int32) % 50)
        y = tf.reduce_sum(h2 * more)
        return Case([y], [table, w1], lists=[[e], [h], [h2], [e, h2]], marks=[h])
    return build


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("table_kind", ["variable", "read", "tensor"])
def test_embedding_gradients_stay_indexed_slices(kind, table_kind):
    _, sparse = compare_strategies(kind, _embedding_model(table_kind), {"x": X})
    assert sparse["tf"] == [True, False]
    for label, flags in sparse.items():
        assert flags == [True, False], label


def _measure_embedding(mode):
    return run_isolated("_memory_cases_hard:embedding", env={"PYTHONPATH": TESTS_DIR},
                        mode=mode, table="variable")


@pytest.mark.measures
def test_embedding_peak_memory_is_not_above_tf_gradients():
    baseline = _measure_embedding("tf")
    got = _measure_embedding("memory")
    assert baseline["table_gradient"] == got["table_gradient"] == "IndexedSlices"
    # The ~51 MB table is alive in both; a densified gradient would add another 51 MB.
    assert baseline["peak_mb"] > 51, baseline
    assert got["peak_mb"] <= baseline["peak_mb"], (got, baseline)
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)


# -- dtypes --------------------------------------------------------------------------------

def _mixed_precision_model(inputs):
    x = inputs["x"]
    w1, w2, _ = _weights()
    h = tf.matmul(tf.cast(x, tf.float16), tf.cast(w1, tf.float16))
    h1 = tf.tanh(h) * tf.cast(1.5, tf.float16)
    h2 = tf.cast(h1, tf.bfloat16)
    h3 = tf.sin(h2) * h2
    h4 = tf.cast(h3, tf.float32)
    y = tf.reduce_sum(tf.tanh(tf.matmul(h4, w2)) * x)
    return Case([y], [x, w1, w2], lists=[[h], [h1], [h2], [h3], [h1, h4]], marks=[h1, h3])


def _integer_model(inputs):
    x = inputs["x"]
    w1, _, _ = _weights()
    h = tf.tanh(tf.matmul(x, w1))
    positive = tf.cast(h > 0, tf.int32)                      # int tensor inside the region
    column = tf.argmax(h, axis=1, output_type=tf.int32)      # int64/int32 outputs
    picked = tf.gather(h, column, axis=1, batch_dims=1)
    masked = h * tf.cast(positive, tf.float32)
    count = tf.cast(tf.reduce_sum(positive), tf.float32)
    shape_dependent = tf.reshape(masked, tf.stack([tf.shape(h)[0] * 2, -1]))
    y = tf.reduce_sum(masked * h) + tf.reduce_sum(picked) + count + tf.reduce_sum(shape_dependent ** 3)
    return Case([y], [x, w1], lists=[[positive], [column], [masked], [positive, picked]],
                marks=[positive, masked])


@pytest.mark.parametrize("kind", KINDS)
def test_float16_and_bfloat16_regions_with_casts(kind):
    compare_strategies(kind, _mixed_precision_model, {"x": X})


@pytest.mark.parametrize("kind", KINDS)
def test_integer_tensors_inside_the_region(kind):
    compare_strategies(kind, _integer_model, {"x": X})


# -- shapes ----------------------------------------------------------------------------------

def _shape_model(inputs):
    x = inputs["x"]
    w1, w2, _ = _weights()
    h = tf.tanh(tf.matmul(x, w1))
    left, right = tf.split(h, 2, axis=1)
    rows = tf.unstack(tf.reshape(right, [-1, 3, 1]), axis=1)
    left2 = tf.sin(left) * 2.0
    joined = tf.concat([left2, rows[0] * rows[2], right * right], axis=1)
    h2 = tf.tanh(tf.matmul(joined[:, :6], w2))
    y = tf.reduce_mean(h2) + tf.reduce_sum(rows[1])
    return Case([y], [x, w1, w2], lists=[[left], [right], [left, right], [rows[1]], [left2, h2]],
                marks=[left2])


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_batch_dimension_and_multi_output_ops(kind):
    compare_strategies(kind, _shape_model, {"x": X}, batch_none=True)


def _scalar_model(inputs):
    s = tf.reduce_sum(inputs["x"])
    a = tf.sin(s)
    b = a * a + s
    c = tf.cos(b) * a
    y = tf.exp(c * 0.1)
    return Case([y], [s], lists=[[a], [b], [a, c]], marks=[b])


@pytest.mark.parametrize("kind", KINDS)
def test_scalars(kind):
    compare_strategies(kind, _scalar_model, {"x": X})


# -- stop gradients, several ys, grad_ys, intermediate xs, kwargs ------------------------------

def _chain(x):
    """x -> a -> b -> c -> d: four elementwise steps, returned with a loss."""
    a = tf.sin(x)
    b = tf.tanh(a * 3.0)
    c = tf.cos(b) * a
    d = tf.exp(c * 0.1) * b
    return a, b, c, d


def _existing_stop_gradient_model(inputs):
    a, b, c, d = _chain(inputs["x"])
    frozen = tf.stop_gradient(b * 2.0)
    e = tf.sin(c * frozen) + d
    y = tf.reduce_sum(e * e)
    return Case([y], [inputs["x"]], lists=[[b], [frozen], [c], [frozen, d]], marks=[c])


def _several_ys_model(inputs):
    a, b, c, d = _chain(inputs["x"])
    ys = [tf.reduce_sum(d * b), tf.reduce_mean(c), d, a]
    grad_ys = [tf.constant(2.0), None, tf.ones_like(d) * 0.5, tf.cos(a)]
    return Case(ys, [inputs["x"]], lists=[[b], [c], [d], [a, c]], marks=[b],
                kwargs={"grad_ys": grad_ys})


def _duplicates_model(inputs):
    x = inputs["x"]
    a, b, c, d = _chain(x)
    y = tf.reduce_sum(d)
    return Case([y, y], [x, x, b], lists=[[a], [c], [a, c]], marks=[c])


def _intermediate_xs_model(inputs):
    """xs are intermediate tensors, one computed from another (b from a)."""
    a, b, c, d = _chain(inputs["x"])
    e = tf.sin(d) * c
    y = tf.reduce_sum(e * a)
    return Case([y], [a, b], lists=[[c], [d], [c, d], [e]], marks=[d])


def _stop_gradients_kwarg_model(inputs):
    x = inputs["x"]
    a, b, c, d = _chain(x)
    y = tf.reduce_sum(d * c + a)
    return Case([y], [x, b], lists=[[a], [c], [b, d], [a, c]], marks=[c],
                kwargs={"stop_gradients": [c, b]})


def _unconnected_zero_model(inputs):
    x = inputs["x"]
    unrelated = tf.ones([3, 2]) * 2.0
    a, b, c, d = _chain(x)
    y = tf.reduce_sum(d)
    return Case([y], [x, unrelated, tf.stop_gradient(a)], lists=[[b], [c]], marks=[b],
                kwargs={"unconnected_gradients": "zero"})


def _gradient_options_model(inputs):
    x = inputs["x"]
    a, b, c, d = _chain(x)
    y = tf.reduce_sum(c * d * b)
    return Case([y], [x], lists=[[b], [c, d]], marks=[c],
                kwargs={"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
                        "gate_gradients": True})


GRADIENT_CASES = {
    "existing_stop_gradient": _existing_stop_gradient_model,
    "several_ys_and_grad_ys": _several_ys_model,
    "duplicate_ys_and_xs": _duplicates_model,
    "intermediate_xs": _intermediate_xs_model,
    "stop_gradients_kwarg": _stop_gradients_kwarg_model,
    "unconnected_gradients_zero": _unconnected_zero_model,
    "aggregation_method_and_gate_gradients": _gradient_options_model,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_gradient_arguments(kind, case):
    compare_strategies(kind, GRADIENT_CASES[case], {"x": X})


def test_xs_computed_from_other_xs_pass_their_gradient_on():
    """Regression: with xs=[a, x] and x = f(a), the part of d/da flowing through x
    was dropped (x's own op is outside the region, so no segment carried it)."""
    def build(inputs):
        a = inputs["x"]
        x = tf.tanh(a * 2.0)
        h = tf.sin(x * a)
        y = tf.reduce_sum(tf.cos(h) * x)
        return Case([y], [a, x], lists=[[h]])
    values, _ = compare_strategies("v1", build, {"x": X}, named=("memory",))
    assert np.max(np.abs(values["tf"][0] - values["list0"][0])) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_an_x_that_is_one_output_of_a_split_on_the_path(kind):
    """Regression (found by test_properties): with x0 -> split -> (s0, s1), xs=[x0, s1] and
    y = f(s0), the split op (s1's op) was left out of the region and not kept, so nothing
    carried the gradient of s0 back to x0: memsave gave None (or half the gradient)."""
    def build(inputs):
        x0 = inputs["x"]
        s0, s1 = tf.split(tf.concat([x0, tf.tanh(x0)], axis=1), 2, axis=1)
        h = tf.tanh(s0)
        y = tf.reduce_sum(tf.sin(h) * h) + tf.reduce_sum(x0)
        return Case([y], [x0, s1], lists=[[h], []], marks=[h])
    compare_strategies(kind, build, {"x": X})


@pytest.mark.parametrize("kind", KINDS)
def test_second_order_gradients_through_memsave(kind):
    """Regression: segments read their inputs through stop_gradient, which made every
    gradient taken *through* memsave's result None (a gradient penalty was silently
    dropped, a Hessian-vector product was None). Now they match tf.gradients."""
    def body(graph, inputs):
        x = inputs["x"]
        w1, w2, _ = _weights()
        h = tf.tanh(tf.matmul(x, w1))
        h2 = tf.sin(tf.matmul(h, w2)) * h
        y = tf.reduce_sum(h2 * h2)
        memsave.mark_checkpoint(h)
        vector = tf.ones_like(x) * 0.3

        def second_order(gradient_fn):
            dx, dw1 = gradient_fn(y, [x, w1])
            penalty = tf.reduce_sum(dx * dx) + tf.reduce_sum(dw1 * dw1)
            hessian_vector = tf.gradients(tf.reduce_sum(dx * vector), [x, w1])
            return tf.gradients(penalty + y, [x, w1, w2]) + hessian_vector

        results = {"tf": second_order(tf.gradients)}
        for label, checkpoints in [("memory", "memory"), ("speed", "speed"),
                                   ("collection", "collection"), ("list", [h, h2])]:
            results[label] = second_order(
                lambda ys, xs: memsave.gradients(ys, xs, checkpoints=checkpoints))
        return results
    values = evaluate(kind, body, {"x": X})
    for label, got in values.items():
        assert all(g is not None for g in got), label
        assert_same_gradients(values["tf"], got, label=f"{kind}/{label}")


# -- variables ----------------------------------------------------------------------------------

def _variables_model(variable_kind):
    variable = variable_store()

    def build(inputs):
        x = inputs["x"]
        if variable_kind == "ref":
            w1, w2 = (variable(i, lambda: tf.compat.v1.Variable(W_VALUES[i], use_resource=False))
                      for i in range(2))
        else:
            w1, w2 = (variable(i, lambda: tf.Variable(W_VALUES[i])) for i in range(2))
        h = tf.tanh(tf.matmul(x, w1))
        h2 = tf.sin(tf.matmul(h, w2)) * h
        y = tf.reduce_sum(tf.tanh(tf.matmul(h2, w1)))
        return Case([y], [w1, w2], lists=[[h], [h2]], marks=[h])
    return build


@pytest.mark.parametrize("kind,variable_kind", [("v1", "resource"), ("v1", "ref"),
                                                ("function", "resource")])
def test_variables_as_xs(kind, variable_kind):
    compare_strategies(kind, _variables_model(variable_kind), {"x": X})


def test_keras_variables_as_xs():
    """Keras 3 variables are no tf.Variable (and have no read_value)."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(3)
    dense1, dense2 = keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((6,)), dense1, dense2])

    def build(inputs):
        h = dense1(inputs["x"])
        y = tf.reduce_sum(dense2(tf.sin(h) * h) ** 2)
        return Case([y], list(model.trainable_variables), lists=[[h]], marks=[h])
    compare_strategies("function", build, {"x": X})


def test_evaluate_returns_none_gradients():
    """The harness itself: None gradients come back as None in both graph kinds."""
    for kind in KINDS:
        def body(graph, inputs):
            return {"g": tf.compat.v1.gradients(tf.reduce_sum(inputs["x"]), [inputs["x"], tf.ones([2])])}
        values = evaluate(kind, body, {"x": X})
        assert values["g"][1] is None
