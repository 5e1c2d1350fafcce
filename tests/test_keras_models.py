"""Models built from Keras' own layers and applications, in float64, give tf.gradients'
gradients under memsave: attention (`MultiHeadAttention`, a causal mask), a sparse
`Embedding` gradient, ConvNeXt, whose grouped convolutions Keras runs as nested
jit-compiled functions that memsave recomputes (tests/test_calls.py has the small cases),
and stacked LSTMs, whose loops memsave differentiates through recomputing copies
(tests/test_loops.py), in chunks where the loop is long.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.graph import calls

from _gradcheck import assert_same_gradients, is_copy

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import models  # noqa: E402

CASES = {
    "gpt": dict(depth=2, batch=2, seq_len=16, d_model=16, heads=2, vocab=50),
    "vit": dict(depth=2, batch=2, image_size=16, patch=4, d_model=16, heads=2),
    "convnext": dict(batch=2, app="ConvNeXtTiny", image_size=32),
    "lstm": dict(depth=2, batch=3, seq_len=5, units=6, features=4, classes=3),
    # One LSTM over 20 steps, outputting the last: its carries are most of what its copy
    # holds, and 'auto' runs the copy in chunks of 4.
    "lstm_chunks": dict(depth=1, batch=3, seq_len=20, units=6, features=2, classes=3),
}
BENCHMARK_MODEL = {"convnext": "keras", "lstm_chunks": "lstm"}
# Gradients that are zero in exact arithmetic (attention's key bias: softmax ignores a
# constant added to every key) come out as float64 rounding noise, around 1e-17.
ATOL = 1e-13


@pytest.fixture
def float64_keras():
    """Keras builds in float64: floatx, and the global dtype policy, which the first layer
    built fixes at the floatx of that moment (float32 after any earlier test's model)."""
    import keras
    from keras.src.backend.common import global_state

    floatx, policy = keras.config.floatx(), global_state.get_global_attribute("dtype_policy")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    global_state.set_global_attribute("dtype_policy", policy)


@pytest.mark.parametrize("name", sorted(CASES))
def test_keras_layer_models_are_exact_in_float64(name, float64_keras):
    check_in_float64(name)


def check_in_float64(name):
    """Asserts memsave's gradients equal tf.gradients' for model `name` (built in float64)."""
    options = dict(CASES[name])
    model = models.build_model(BENCHMARK_MODEL.get(name, name), seed=0, **options)
    inputs = [a.astype(np.float64) if a.dtype == np.float32 else a for a in model.inputs]
    reports = []

    @tf.function(autograph=False)
    def step(*features):
        loss = model.loss(*features)
        expected = tf.gradients(loss, model.variables)
        got = memsave.gradients(loss, model.variables, checkpoints="memory")
        reports.append(memsave.last_report())
        return expected, got

    expected, got = step(*inputs)
    assert reports[-1].fallback is None and len(reports[-1].segments) >= 2, reports[-1].summary()
    assert [type(g) for g in expected] == [type(g) for g in got]  # (sparse stays sparse)
    assert_same_gradients([tf.convert_to_tensor(g).numpy() for g in expected],
                          [tf.convert_to_tensor(g).numpy() for g in got], rtol=1e-12, atol=ATOL)
    if name == "convnext":
        graph = step.get_concrete_function(*inputs).graph
        assert any(is_copy(op) and calls.is_call(op) for op in graph.get_operations())
    if name == "gpt":
        assert any(isinstance(g, tf.IndexedSlices) for g in got)
    if name == "lstm":  # (each LSTM's loop differentiated through a recomputing copy)
        assert [why.split(" ")[0] for _, why in reports[-1].loops] == ["recomputed"] * 2
    if name == "lstm_chunks":
        (_, why), = reports[-1].loops
        assert why.startswith("recomputed in the backward pass (20 iterations, in chunks of 4)"), why
    assert all(v.dtype == tf.float64 for v in model.variables)


def _recurrent_model(kind, steps, features, units):
    import keras

    layers = keras.layers
    keras.utils.set_random_seed(1)
    sequence = keras.Input((steps, features))
    if kind == "gru":
        x = layers.GRU(units)(sequence)
    elif kind == "bidirectional":
        x = layers.Bidirectional(layers.LSTM(units, return_sequences=True))(sequence)
        x = layers.LSTM(units, go_backwards=True)(x)
    else:  # masked: steps whose features are all 0 are skipped (a tf.where in the loop)
        x = layers.LSTM(units)(layers.Masking(0.0)(sequence))
    return keras.Model(sequence, layers.Dense(2)(x))


@pytest.mark.parametrize("kind", ["gru", "bidirectional", "masked"])
def test_keras_recurrent_layers_in_chunks_are_exact_in_float64(kind, float64_keras):
    """Keras' GRU, a Bidirectional LSTM and a reversed one, a masked LSTM, each loop
    recomputed in chunks of 3 over 13 steps (a last chunk of 1)."""
    steps, batch, features = 13, 3, 4
    model = _recurrent_model(kind, steps, features, units=5)
    data = np.random.default_rng(0).standard_normal([batch, steps, features])
    data[1, 9:] = 0.0
    reports = []

    @tf.function(autograph=False)
    def step(x):
        loss = tf.reduce_sum(tf.sin(model(x, training=True)))
        expected = tf.gradients(loss, model.trainable_variables)
        with memsave.always_rewrite(), memsave.recompute_loops("always", chunk=3):
            got = memsave.gradients(loss, model.trainable_variables, checkpoints="memory")
        reports.append(memsave.last_report())
        return expected, got

    expected, got = step(data)
    assert_same_gradients([g.numpy() for g in expected], [g.numpy() for g in got],
                          rtol=1e-12, atol=ATOL)
    whys = [why for _, why in reports[-1].loops]
    assert whys and all("in chunks of 3" in why for why in whys), whys
