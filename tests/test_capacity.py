"""memsave.capacity and memsave.keras.max_batch_size: the largest batch predicted to fit
in a memory limit, with memsave's plan and with plain TensorFlow."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
from _models import tanh_mlp_loss
from memsave import capacity

WIDTH, DEPTH = 64, 6


def test_memory_limits_parse_bytes_and_text_and_name_a_bad_one():
    assert capacity.parse_memory_limit(1000) == 1000
    assert capacity.parse_memory_limit("8GiB") == 8 << 30
    assert capacity.parse_memory_limit("512 MiB") == 512 << 20
    assert capacity.parse_memory_limit("16GB") == 16 * 10**9
    assert capacity.parse_memory_limit("1.5gib") == 3 << 29
    for bad in ("8 parsecs", "", -1, 0, True, None, "0MiB"):
        with pytest.raises(memsave.MemsaveError, match="memory_limit is .*'8GiB'"):
            capacity.parse_memory_limit(bad)


@pytest.mark.parametrize("peaks, expected", [
    (lambda b: 1000 + 10 * b, 900),                         # affine: (10000 - 1000) / 10
    (lambda b: 1000 + 10 * b if b < 300 else 500 + 9 * b, 1055),  # a plan that changes
    (lambda b: 20000 + b, 0),                               # not even one example
    (lambda b: 10 * b, 1000),                               # exactly at the limit
    (lambda b: 1, 1 << 12),                                 # never over: max_batch
])
def test_the_search_finds_the_largest_batch_within_the_limit(peaks, expected):
    calls = []

    def peak(batch):
        calls.append(batch)
        return peaks(batch)

    assert capacity._largest_within(peak, 10000, 1 << 12) == expected
    assert len(set(calls)) <= 2 * 13 + 4, calls  # doubling, then a few guesses


def _mlp(optimizer="adam"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(DEPTH):
        h = keras.layers.Dense(WIDTH, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _sample():
    return np.zeros((3, WIDTH), "float32"), np.zeros((3,), "int32")


@pytest.mark.planner_fallback
def test_keras_answers_are_the_largest_batches_predicted_within_the_limit():
    model = _mlp()
    x, y = _sample()
    found = memsave.keras.max_batch_size(model, 8 << 20, x=x, y=y, headroom=0.1)
    assert found.memory_limit == 8 << 20 and found.limit_source == "given"
    limit = found.usable_bytes
    assert limit == int(0.9 * (8 << 20))
    assert found.batch_size > found.baseline_batch_size > 0, found.summary()
    # Each answer is predicted within the limit, and one more example is not.
    assert found.at(found.batch_size).peak_bytes <= limit < found.at(found.batch_size + 1).peak_bytes
    baseline = found.baseline_batch_size
    assert (found.at(baseline).baseline_peak_bytes <= limit
            < found.at(baseline + 1).baseline_peak_bytes)
    # Every batch was planned for itself, with Adam's state (two slots per weight).
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    for smaller, larger in zip(found.peaks, found.peaks[1:]):  # (each traced for its batch)
        assert smaller.baseline_peak_bytes < larger.baseline_peak_bytes
    for peak in found.peaks:
        assert peak.report.beside_bytes >= 2 * weights
    assert found.at(found.batch_size).step_time > 1.0
    text = found.summary()
    assert f"memsave {found.batch_size}" in text and f"plain TensorFlow {baseline}" in text
    assert "8.0 MiB (given; the answers leave 10% free: within 7.2 MiB)" in text


def test_adams_two_slots_per_weight_are_in_every_answers_peak():
    # Traced for one batch, Adam's step is predicted to hold two weights' worth more than
    # plain SGD's (no slots), for memsave's plan and for plain TensorFlow alike.
    x, y = _sample()
    peaks = {}
    for name in ("adam", "sgd"):
        model = _mlp(name)
        model.optimizer.build(model.trainable_variables)
        peaks[name] = capacity._traced_peak(
            lambda data, model=model: memsave.keras.train_step(model, data),
            [memsave.integrations.keras_batch.data_signature(x, y)], 64,
            lambda model=model: memsave.integrations.keras_batch.optimizer_state(model))
    weights = sum(int(np.prod(v.shape)) * 4 for v in _mlp().trainable_weights)
    for field in ("peak_bytes", "baseline_peak_bytes"):
        extra = getattr(peaks["adam"], field) - getattr(peaks["sgd"], field)
        assert 2 * weights <= extra <= 2.2 * weights, (field, extra, weights)


def test_a_tf_function_step_is_sized_from_its_input_signature():
    weights = [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=0.1)) for _ in range(DEPTH)]

    @tf.function
    def step(x):
        grads = memsave.gradients(tanh_mlp_loss(x, weights), weights, checkpoints="memory")
        for w, g in zip(weights, grads):
            w.assign_sub(0.01 * g)

    found = memsave.max_batch_size(step, tf.TensorSpec([None, WIDTH]), "16MiB")
    assert found.batch_size >= found.baseline_batch_size > 0
    assert found.at(found.batch_size).peak_bytes <= 16 << 20
    # The user's function is not retraced for the search.
    assert step.experimental_get_tracing_count() == 0


def test_bad_inputs_are_named():
    model = _mlp()
    x, y = _sample()
    with pytest.raises(memsave.MemsaveError, match="memory_limit is None and this machine"):
        memsave.keras.max_batch_size(model, x=x, y=y)
    with pytest.raises(memsave.MemsaveError, match="needs a compiled model"):
        memsave.keras.max_batch_size(keras.Sequential([keras.layers.Dense(2)]), "1GiB")
    with pytest.raises(memsave.MemsaveError, match="no input whose leading dimension is None"):
        memsave.max_batch_size(lambda x: x, [tf.TensorSpec([4, 2])], "1GiB")
    with pytest.raises(memsave.MemsaveError, match="pass a list of tf.TensorSpec"):
        memsave.max_batch_size(lambda x: x, [np.zeros(3)], "1GiB")
    with pytest.raises(memsave.MemsaveError, match="0.9; pass a positive number.*headroom="):
        capacity.parse_memory_limit(0.9)
    assert capacity.parse_memory_limit(np.int64(1 << 30)) == 1 << 30
    with pytest.raises(memsave.MemsaveError, match="max_batch is 0"):
        memsave.keras.max_batch_size(model, "1GiB", x=x, y=y, max_batch=0)
    with pytest.raises(memsave.MemsaveError, match="headroom is 1.5; pass the share"):
        memsave.keras.max_batch_size(model, "1GiB", x=x, y=y, headroom=1.5)
    with pytest.raises(memsave.MemsaveError, match="made no memsave call"):
        memsave.max_batch_size(lambda x: x * 2, [tf.TensorSpec([None, 2])], "1GiB")


def test_a_memsave_models_own_strategy_is_sized_unless_another_is_asked_for():
    x, y = _sample()
    model = memsave.keras.enable(_mlp(), checkpoints="speed")
    assert memsave.keras.max_batch_size(model, "8MiB", x=x, y=y, max_batch=64).strategy == "speed"
    asked = memsave.keras.max_batch_size(model, "8MiB", x=x, y=y, checkpoints="collection",
                                         max_batch=64)
    assert asked.strategy == "collection"
