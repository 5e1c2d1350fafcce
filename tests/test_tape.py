"""memsave.GradientTape answers as tf.GradientTape, computed by memsave, and
memsave.patch routes tf.GradientTape (Keras' own fit) through it.

Each case records the same computation on a tf.GradientTape and a
memsave.GradientTape in one tf.function (float64) and compares the structures, the
Nones and the values; the report shows memsave built segments.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsave

from _gradcheck import assert_same_gradients

RNG = np.random.RandomState(0)
W_VALUES = [RNG.standard_normal([8, 8]) / 3 for _ in range(6)]
X = RNG.standard_normal([16, 8])


def _chain(h, weights):
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    return h


def _both(record, sources_of, persistent=False, **gradient_kwargs):
    """Runs `record(tape)` -> target under each tape in one tf.function and returns
    (tf.GradientTape's gradients, memsave.GradientTape's, memsave's report)."""
    reports = []

    @tf.function
    def step(x):
        results = []
        for tape_class in (tf.GradientTape, memsave.GradientTape):
            with tape_class(persistent=persistent) as tape:
                target = record(tape, x)
            results.append(tape.gradient(target, sources_of(x), **gradient_kwargs))
            if tape_class is memsave.GradientTape:
                reports.append(memsave.last_report())
        return results

    expected, got = step(tf.constant(X))
    return expected, got, reports[-1]


def _flat(structure):
    return [g if g is None or isinstance(g, tf.IndexedSlices) else np.asarray(g)
            for g in tf.nest.flatten(structure)]


def test_same_gradients_as_the_tape_and_segments_built():
    weights = [tf.Variable(w) for w in W_VALUES]

    def record(tape, x):
        return tf.reduce_sum(_chain(x, weights) ** 2)
    expected, got, report = _both(record, lambda x: weights)
    assert report.fallback is None and len(report.segments) >= 2, report.summary()
    assert_same_gradients(_flat(expected), _flat(got), rtol=1e-12)


def test_nested_sources_unwatched_tensors_and_zeros():
    weights = [tf.Variable(w) for w in W_VALUES]

    def record(tape, x):
        tape.watch(x)
        return tf.reduce_sum(_chain(x, weights) ** 2)

    def sources(x):
        unwatched = x * 2.0  # made before the tape: not watched, so None (or zeros)
        return {"weights": weights[:3], "more": (weights[3:], x), "unwatched": unwatched}
    expected, got, _ = _both(record, sources)
    assert tf.nest.map_structure(lambda g: g is None, expected) == \
        tf.nest.map_structure(lambda g: g is None, got)
    assert got["unwatched"] is None
    assert_same_gradients([g for g in _flat(expected) if g is not None],
                          [g for g in _flat(got) if g is not None], rtol=1e-12)
    expected, got, _ = _both(record, sources, unconnected_gradients="zero")
    np.testing.assert_array_equal(got["unwatched"], np.zeros_like(X))
    assert_same_gradients(_flat(expected), _flat(got), rtol=1e-12)


def test_stop_recording_and_ops_made_before_the_tape():
    """The tape differentiates only what it recorded: a layer applied before it starts
    and a part of the loss computed inside stop_recording() pass no gradient."""
    weights = [tf.Variable(w) for w in W_VALUES]
    early = tf.Variable(RNG.standard_normal([8, 8]) / 3)

    def step_with(tape_class):
        @tf.function
        def step(x):
            h0 = tf.tanh(tf.matmul(x, early))  # before the tape
            with tape_class() as tape:
                h = _chain(h0, weights[:3])
                with tape.stop_recording():
                    h = h + _chain(h, weights[3:4])  # (no gradient to weights[3] from here)
                h = _chain(h, weights[3:])
                target = tf.reduce_sum(h * h)
            return tape.gradient(target, [early] + weights)
        return step(tf.constant(X))

    expected = step_with(tf.GradientTape)
    got = step_with(memsave.GradientTape)
    assert expected[0] is None and got[0] is None
    assert_same_gradients(_flat(expected[1:]), _flat(got[1:]), rtol=1e-12)


def test_output_gradients_persistent_tapes_and_sparse_gradients():
    table = tf.Variable(RNG.standard_normal([50, 8]))
    weights = [tf.Variable(w) for w in W_VALUES]
    ids = tf.constant([1, 3, 3, 7, 49, 0, 2, 5, 8, 9, 10, 11, 12, 13, 14, 15])

    def record(tape, x):
        h = tf.nn.embedding_lookup(table, ids) + x
        return _chain(h, weights)

    seed = RNG.standard_normal([16, 8])

    def body(tape_class, x):
        with tape_class(persistent=True) as tape:
            target = record(tape, x)
        first = tape.gradient(target, [table] + weights, output_gradients=tf.constant(seed))
        return first, tape.gradient(tf.reduce_sum(target), weights)  # (persistent: again)

    (expected, expected_again), (got, got_again) = _tape_and_memsave(body, tf.constant(X))
    assert isinstance(expected[0], tf.IndexedSlices) and isinstance(got[0], tf.IndexedSlices)
    assert_same_gradients(_flat(expected), _flat(got), rtol=1e-12)
    assert_same_gradients(_flat(expected_again), _flat(got_again), rtol=1e-12)


def test_a_non_persistent_tape_answers_once():
    weights = [tf.Variable(w) for w in W_VALUES[:2]]

    @tf.function
    def step(x):
        with memsave.GradientTape() as tape:
            target = tf.reduce_sum(_chain(x, weights))
        tape.gradient(target, weights)
        with pytest.raises(RuntimeError, match="non-persistent GradientTape"):
            tape.gradient(target, weights)
        return target
    step(tf.constant(X))


def test_eagerly_it_is_the_tape_and_says_once_that_it_saved_nothing(monkeypatch):
    from memsave import tape as tape_module
    monkeypatch.setattr(tape_module, "_said_eager", [])
    weights = [tf.Variable(w) for w in W_VALUES[:2]]
    results = []
    with pytest.warns(memsave.MemsaveWarning, match="called eagerly.*inside a tf.function"):
        for tape_class in (tf.GradientTape, memsave.GradientTape):
            with tape_class() as tape:
                target = tf.reduce_sum(_chain(tf.constant(X), weights))
            results.append(tape.gradient(target, weights))
    assert_same_gradients(_flat(results[0]), _flat(results[1]), rtol=0)
    assert "called eagerly" in memsave.last_report().fallback
    assert "saved no memory" in memsave.last_report().fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once: the second call only reports)
        with memsave.GradientTape(checkpoints="speed") as tape:
            target = tf.reduce_sum(_chain(tf.constant(X), weights))
        tape.gradient(target, weights)
    assert memsave.last_report().strategy == "speed"


def test_jacobian_is_the_tapes():
    w = tf.Variable(W_VALUES[0])

    @tf.function
    def step(x):
        results = []
        for tape_class in (tf.GradientTape, memsave.GradientTape):
            with tape_class() as tape:
                y = tf.tanh(tf.matmul(x[:2], w))
            results.append(tape.jacobian(y, w))
        return results
    expected, got = step(tf.constant(X))
    np.testing.assert_array_equal(expected.numpy(), got.numpy())


def test_patch_routes_gradient_tapes_and_restores_them():
    original = tf.GradientTape
    weights = [tf.Variable(w) for w in W_VALUES]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            target = tf.reduce_sum(_chain(x, weights) ** 2)
        assert isinstance(tape, memsave.GradientTape)
        return tape.gradient(target, weights)

    with memsave.patch(checkpoints="memory"):
        assert tf.GradientTape is not original and tf.autodiff.GradientTape is tf.GradientTape
        got = step(tf.constant(X))
        report = memsave.last_report()
    assert tf.GradientTape is original and tf.autodiff.GradientTape is original
    assert report.strategy == "memory" and report.fallback is None and report.segments
    expected = tf.function(lambda x: tf.gradients(tf.reduce_sum(_chain(x, weights) ** 2),
                                                  weights))(tf.constant(X))
    assert_same_gradients(_flat(expected), _flat(got), rtol=1e-12)


def test_keras_fit_under_the_patch_computes_with_memsave():
    keras = pytest.importorskip("keras")
    y = np.linspace(-1.0, 1.0, 16).reshape(16, 1)

    def fit(patched):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,))]
                                 + [keras.layers.Dense(16, activation="tanh", dtype="float64")
                                    for _ in range(6)] + [keras.layers.Dense(1, dtype="float64")])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        if patched:
            with memsave.patch(checkpoints="memory"):
                model.fit(X, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
            report = memsave.last_report()
            assert report is not None and report.fallback is None and report.segments
        else:
            model.fit(X, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        return [w.numpy() for w in model.weights]

    expected, got = fit(False), fit(True)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)


def _tape_and_memsave(step_body, *args):
    """step_body(tape_class, *args) traced in one tf.function per tape class."""
    results = []
    for tape_class in (tf.GradientTape, memsave.GradientTape):
        results.append(tf.function(lambda *a, c=tape_class: step_body(c, *a),
                                   autograph=False)(*args))
    return results


def test_gradients_of_intermediate_tensors_and_tensors_watched_late():
    """A source the tape computed (a layer's output, as Grad-CAM asks) has a gradient;
    an op made before its input was watched is not recorded."""
    weights = [tf.Variable(w) for w in W_VALUES[:4]]

    def body(tape_class, x):
        with tape_class(watch_accessed_variables=False) as tape:
            tape.watch(weights[0])
            early = x * x              # made before x is watched: not recorded
            tape.watch(x)
            h = _chain(x + early, weights[:2])
            target = tf.reduce_sum(_chain(h, weights[2:]) ** 2)
        return tape.gradient(target, {"x": x, "h": h, "w": weights[:2], "early": early})

    expected, got = _tape_and_memsave(body, tf.constant(X))
    assert tf.nest.map_structure(lambda g: g is None, expected) == \
        tf.nest.map_structure(lambda g: g is None, got)
    assert got["h"] is not None and got["w"][1] is None and got["early"] is None
    assert_same_gradients([g for g in _flat(expected) if g is not None],
                          [g for g in _flat(got) if g is not None], rtol=1e-12)


def test_zeros_for_unwatched_sources_of_unknown_shape():
    weights = [tf.Variable(w) for w in W_VALUES]

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float64)])
    def step(x):
        unwatched = x * 3.0
        with memsave.GradientTape() as tape:
            target = tf.reduce_sum(_chain(x, weights) ** 2)
        return tape.gradient(target, [unwatched] + weights, unconnected_gradients="zero")
    got = step(tf.constant(X))
    np.testing.assert_array_equal(got[0].numpy(), np.zeros_like(X))


def test_a_non_persistent_tape_entered_again_starts_afresh():
    weights = [tf.Variable(w) for w in W_VALUES[:3]]

    def body(tape_class, x):
        tape = tape_class()
        with tape:
            first = tf.reduce_sum(_chain(x, weights))
        a = tape.gradient(first, weights)
        with tape:
            second = tf.reduce_sum(_chain(x * 2.0, weights[1:]))
        return a, tape.gradient(second, weights)

    (expected_a, expected_b), (got_a, got_b) = _tape_and_memsave(body, tf.constant(X))
    assert expected_b[0] is None and got_b[0] is None
    assert_same_gradients(_flat(expected_a), _flat(got_a), rtol=1e-12)
    assert_same_gradients(_flat(expected_b)[1:], _flat(got_b)[1:], rtol=1e-12)


def test_second_order_gradients_with_an_outer_tape_are_exact():
    """An outer tape does not record memsave's copies: inside one, memsave answers as the
    plain tape (and memsave.gradients as tf.gradients), so the outer gradient is right."""
    weights = [tf.Variable(w) for w in W_VALUES]

    def body(tape_class, x):
        with tf.GradientTape() as outer:
            with tape_class() as inner:
                target = tf.reduce_sum(tf.sin(_chain(x, weights)) ** 2)
            grads = inner.gradient(target, weights)
            penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
        return outer.gradient(penalty, weights)

    expected, got = _tape_and_memsave(body, tf.constant(X))
    assert_same_gradients(_flat(expected), _flat(got), rtol=1e-12)

    @tf.function
    def with_gradients(x):
        with tf.GradientTape() as outer:
            target = tf.reduce_sum(tf.sin(_chain(x, weights)) ** 2)
            grads = memsave.gradients(target, weights, checkpoints="memory")
            penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
        return outer.gradient(penalty, weights)
    assert_same_gradients(_flat(expected), _flat(with_gradients(tf.constant(X))), rtol=1e-12)
    report = memsave.last_report()
    assert report.fallback and "GradientTape is recording" in report.fallback


def test_a_tape_made_outside_the_patch_is_the_plain_tape():
    with memsave.patch(checkpoints="memory"):
        patched_class = tf.GradientTape
    weights = [tf.Variable(w) for w in W_VALUES]
    memsave.report._latest.report = memsave.report._latest_of_any_thread[0] = None

    @tf.function
    def step(x):
        with patched_class() as tape:
            target = tf.reduce_sum(_chain(x, weights) ** 2)
        return tape.gradient(target, weights)
    step(tf.constant(X))
    assert memsave.last_report() is None


def test_autograph_leaves_memsave_alone():
    """A training step traced with AutoGraph (tf.function's default) calls memsave's
    entry points as they are: AutoGraph would otherwise transpile memsave's own code,
    turning its Python `if`s into graph conditionals."""
    from memsave.integrations import patch

    entry_points = [memsave.gradients, memsave.GradientTape.gradient,
                    memsave.GradientTape.jacobian, patch._make_dispatcher(tf.gradients),
                    patch._patched_tape_class(tf.GradientTape).gradient]
    for entry in entry_points:
        assert hasattr(entry, "autograph_info__"), entry  # (AutoGraph's own mark)
