"""gradient_function, MemsaveOptimizer, the tf.function training-step pattern, eager errors.

Every test compares with the unpatched tf.gradients run of the same model. (The
memory saving of a tf.function training step is measured in test_memory.py and,
through Keras' compiled step, in test_integrations_keras.py.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave



def _weights(depth, width, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(depth)]


def _mlp_loss(x, weights, mark=False):
    h = x
    for i, w in enumerate(weights):
        h = tf.tanh(tf.matmul(h, w))
        if mark and i % 2 == 1:
            memsave.mark_checkpoint(h)
    return tf.reduce_mean(h * h)


# ------------------------------------------------------------ gradient_function
@pytest.mark.parametrize("checkpoints", ["collection", "memory", "speed"])
def test_gradient_function_matches_tf_gradients(run_graph, checkpoints):
    x_value = np.random.RandomState(1).randn(4, 8).astype(np.float32)
    grad_fn = memsave.gradient_function(checkpoints=checkpoints)
    assert grad_fn.checkpoints == checkpoints

    def build(graph, inputs):
        weights = [tf.constant(w) for w in _weights(5, 8)]
        loss = _mlp_loss(inputs["x"], weights, mark=True)
        seed = tf.constant(2.0)
        expected = tf.gradients(loss, weights, grad_ys=seed)
        # tf.gradients-style keywords and tf.compat.v1.gradients-style positionals.
        by_name = grad_fn(loss, weights, grad_ys=seed, gate_gradients=True)
        by_position = grad_fn(loss, weights, seed, "grads", True)
        return expected, by_name, by_position

    expected, by_name, by_position = run_graph(build, {"x": x_value})
    for got in (by_name, by_position):
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_function_refuses_unknown_strategy():
    with pytest.raises(memsave.MemsaveError, match="unknown checkpoints strategy 'sqrt'.*memory"):
        memsave.gradient_function(checkpoints="sqrt")


# ------------------------------------------------------------ MemsaveOptimizer
def _train_v1(make_optimizer, steps=5, gate=tf.compat.v1.train.Optimizer.GATE_OP):
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, (16, 12))
        y = tf.compat.v1.placeholder(tf.float32, (16, 1))
        weights = [tf.Variable(w, name=f"w{i}") for i, w in enumerate(_weights(6, 12, seed=2))]
        head = tf.Variable(rng.randn(12, 1).astype(np.float32) * 0.3, name="head")
        h = x
        for i, w in enumerate(weights):
            h = tf.tanh(tf.matmul(h, w))
            if i % 2:
                memsave.mark_checkpoint(h)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, head) - y))
        opt = make_optimizer()
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = opt.minimize(loss, global_step=global_step, gate_gradients=gate)
        feed = {x: rng.randn(16, 12).astype(np.float32), y: rng.randn(16, 1).astype(np.float32)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([loss, train_op], feed)[0] for _ in range(steps)]
            opt.variables_in_graph = opt.variables()
            return losses, sess.run(global_step), opt


@pytest.mark.parametrize("checkpoints", ["collection", "memory"])
def test_memsave_optimizer_sgd_losses_match(checkpoints):
    plain, _, _ = _train_v1(lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05))
    memsaved, step, opt = _train_v1(lambda: memsave.MemsaveOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.05), checkpoints=checkpoints))
    np.testing.assert_allclose(memsaved, plain, rtol=1e-5)
    assert plain[-1] < plain[0]
    assert step == 5
    assert opt.checkpoints == checkpoints
    assert tf.gradients.__module__ == "tensorflow.python.ops.gradients_impl"  # nothing patched


def test_memsave_optimizer_adam_slots_and_gate_graph():
    plain, _, _ = _train_v1(lambda: tf.compat.v1.train.AdamOptimizer(0.01),
                            gate=tf.compat.v1.train.Optimizer.GATE_GRAPH)
    memsaved, _, opt = _train_v1(
        lambda: memsave.MemsaveOptimizer(tf.compat.v1.train.AdamOptimizer(0.01), "memory"),
        gate=tf.compat.v1.train.Optimizer.GATE_GRAPH)
    np.testing.assert_allclose(memsaved, plain, rtol=1e-5)
    assert sorted(opt.get_slot_names()) == ["m", "v"]
    # The wrapped Adam's beta powers and its m and v slots of the 7 variables.
    assert len(opt.variables_in_graph) == 2 + 2 * 7
    assert isinstance(opt.optimizer, tf.compat.v1.train.AdamOptimizer)


def test_memsave_optimizer_in_tf_function_with_callable_loss():
    x_value = np.random.RandomState(5).randn(8, 10).astype(np.float32)

    def run(wrap):
        weights = [tf.Variable(w) for w in _weights(4, 10, seed=3)]
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        if wrap:
            opt = memsave.MemsaveOptimizer(opt, checkpoints="memory")

        @tf.function
        def step(x):
            loss = lambda: _mlp_loss(x, weights)  # noqa: E731
            opt.minimize(loss)  # var_list: the variables the loss read
            return _mlp_loss(x, weights)

        return [float(step(x_value)) for _ in range(3)]

    np.testing.assert_allclose(run(True), run(False), rtol=1e-5)


def test_memsave_optimizer_refuses_bad_input_and_eager():
    with pytest.raises(memsave.MemsaveError, match="wraps a tf.compat.v1.train.Optimizer"):
        memsave.MemsaveOptimizer(object())
    with pytest.raises(memsave.MemsaveError, match="unknown checkpoints strategy"):
        memsave.MemsaveOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), "fastest")
    opt = memsave.MemsaveOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), "memory")
    v = tf.Variable(1.0)
    with pytest.raises(memsave.MemsaveError, match=r"(?s)memsave:.*tf\.function.*@tf\.function"):
        opt.minimize(lambda: v * v, var_list=[v])


# ------------------------------------------------------------ eager
def test_eager_call_says_to_use_tf_function():
    v = tf.Variable([1.0, 2.0])
    loss = tf.reduce_sum(v * v)
    with pytest.raises(memsave.MemsaveError) as info:
        memsave.gradients(loss, [v], checkpoints="memory")
    message = str(info.value)
    assert message.startswith("memsave:")
    assert "tf.function" in message, message
    with pytest.raises(memsave.MemsaveError, match="tf.function"):
        memsave.gradient_function("speed")(loss, [v])


# ------------------------------------------------------------ custom training loop
def _custom_loop(grad_fn, steps=4):
    """The documented pattern: forward, loss, grad_fn, apply, all in one tf.function."""
    rng = np.random.RandomState(7)
    weights = [tf.Variable(w) for w in _weights(8, 16, seed=4)]
    head = tf.Variable(rng.randn(16, 3).astype(np.float32) * 0.3)
    variables = weights + [head]
    x = rng.randn(32, 16).astype(np.float32)
    labels = rng.randint(0, 3, size=32)
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)

    @tf.function
    def train_step(x, labels):
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        logits = tf.matmul(h, head)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        grads = grad_fn(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    return [float(train_step(x, labels)) for _ in range(steps)]


@pytest.mark.parametrize("checkpoints", ["memory", "speed"])
def test_custom_training_loop_losses_match(checkpoints):
    plain = _custom_loop(tf.gradients)
    memsaved = _custom_loop(lambda ys, xs: memsave.gradients(ys, xs, checkpoints=checkpoints))
    np.testing.assert_allclose(memsaved, plain, rtol=1e-5)
    assert plain[-1] < plain[0]


def test_budget_works_as_gradient_function_and_optimizer_strategy():
    budget = memsave.budget(0.6)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [256, 256])
        w = tf.Variable(np.eye(256, dtype=np.float32) * 0.5)
        h = tf.matmul(x, w)
        for _ in range(16):
            h = tf.tanh(h)
        loss = tf.reduce_sum(h * h)
        expected = tf.gradients(loss, [w])
        by_function = memsave.gradient_function(checkpoints=budget)(loss, [w])
        report = memsave.last_report()
        assert report.segments and report.predicted_peak_bytes <= 0.6 * report.baseline_peak_bytes
        train = memsave.MemsaveOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.0),
                                         checkpoints=budget).minimize(loss, var_list=[w])
        assert memsave.last_report().strategy == "budget(0.6)"
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).uniform(-1, 1, [256, 256]).astype(np.float32)}
            want, have = session.run([expected, by_function], feed)
            session.run(train, feed)
    np.testing.assert_allclose(have[0], want[0], rtol=1e-4, atol=1e-5)
