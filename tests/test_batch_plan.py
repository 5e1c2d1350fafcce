"""Steps traced with a batch of None are planned for the batch they run with:
memsave.batch_size, and Keras 3 `fit` (MemsaveModel, memsave.keras.enable, plain
`fit` under memsave.patch) reading it from what `fit` is given."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import batch as batch_lib
from memsave import report as report_lib
from memsave.integrations import keras_batch

WIDTH, DEPTH, CLASSES = 32, 6, 4


def _data(examples=100, seed=0):  # a partial last batch: Keras traces a batch of None
    rng = np.random.RandomState(seed)
    return (rng.randn(examples, WIDTH).astype("float32"),
            rng.randint(0, CLASSES, size=(examples,)).astype("int32"))


def _model(model_class=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(DEPTH):
        h = keras.layers.Dense(WIDTH, activation="tanh")(h)
    model = model_class(inputs, keras.layers.Dense(CLASSES)(h), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fitted_report(model, x, **fit_kwargs):
    report_lib._latest.report = report_lib._latest_of_any_thread[0] = None  # none of before
    model.fit(x, epochs=1, verbose=0, shuffle=False, **fit_kwargs)
    report = memsave.last_report()
    assert report is not None and report.unknown_dims > 0, report
    return report


def test_a_memsave_model_fit_plans_for_its_batch_size():
    x, y = _data()
    report = _fitted_report(_model(memsave.keras.MemsaveModel), x, y=y, batch_size=16)
    assert report.unknown_dim_size == 16
    assert report.unknown_dim_source == "fit's batch_size=16"
    assert "planned for a batch of 16, from fit's batch_size=16" in report.summary()


def test_fit_without_a_batch_size_plans_for_keras_default_or_the_examples_given():
    x, y = _data()
    assert _fitted_report(_model(memsave.keras.MemsaveModel), x, y=y).unknown_dim_size == 32
    x, y = _data(examples=10)
    few = _fitted_report(_model(memsave.keras.MemsaveModel), x, y=y, batch_size=64)
    assert few.unknown_dim_size == 10 and "10 examples" in few.unknown_dim_source


def test_fit_on_a_dataset_plans_for_its_first_batch():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(24)
    report = _fitted_report(_model(memsave.keras.MemsaveModel), dataset)
    assert (report.unknown_dim_size, report.unknown_dim_source) == (
        24, "the dataset's first batch")
    # A static batch needs no reading (and Keras traces it known: nothing to assume).
    static = tf.data.Dataset.from_tensor_slices((x, y)).batch(24, drop_remainder=True)
    assert keras_batch.fit_batch_size(static) == (24, "the dataset's element_spec")


def test_fit_on_a_py_dataset_plans_for_its_first_batch():
    x, y = _data()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[i * 12:(i + 1) * 12], y[i * 12:(i + 1) * 12]

    report = _fitted_report(_model(memsave.keras.MemsaveModel), Batches())
    assert (report.unknown_dim_size, report.unknown_dim_source) == (
        12, "the PyDataset's first batch")


def test_a_generator_is_not_read_ahead_and_the_report_says_the_batch_was_assumed():
    x, y = _data()
    trained = []

    def batches():
        for i in range(4):
            yield x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]

    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda i, logs: trained.append(i))
    report = _fitted_report(_model(memsave.keras.MemsaveModel), batches(), steps_per_epoch=4,
                            callbacks=[counter])
    assert trained == [0, 1, 2, 3]  # a batch read ahead would be missing from training
    assert report.unknown_dim_size == 1 and report.unknown_dim_source is None
    assert "memsave.batch_size(n)" in report.summary()


def test_the_callers_own_batch_size_wins_over_fits():
    x, y = _data()
    with memsave.batch_size(64, source="my estimate"):
        report = _fitted_report(_model(memsave.keras.MemsaveModel), x, y=y, batch_size=16)
    assert (report.unknown_dim_size, report.unknown_dim_source) == (64, "my estimate")


def test_enable_plans_fit_for_its_batch_and_disable_undoes_it():
    x, y = _data()
    model = memsave.keras.enable(_model())
    assert _fitted_report(model, x, y=y, batch_size=16).unknown_dim_size == 16
    memsave.keras.disable(model)
    assert "fit" not in vars(model) and "train_step" not in vars(model)


def test_plain_fit_under_the_patch_plans_for_its_batch_and_the_patch_restores_fit():
    x, y = _data()
    fit_before = keras.Model.fit
    with memsave.patch(checkpoints="memory"):
        assert keras.Model.fit is not fit_before
        report = _fitted_report(_model(), x, y=y, batch_size=16)
    assert keras.Model.fit is fit_before and "fit" not in vars(keras.Model)
    assert (report.strategy, report.unknown_dim_size) == ("memory", 16)


def test_a_function_traced_inside_batch_size_is_planned_for_it():
    weights = [tf.Variable(tf.random.normal([WIDTH, WIDTH], seed=i) * 0.3) for i in range(DEPTH)]

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH])])
    def step(x):
        h = x
        for w in weights:
            h = tf.tanh(h @ w)
        return memsave.gradients(tf.reduce_sum(h), weights, checkpoints="memory")

    with memsave.batch_size(64):
        step.get_concrete_function()
    report = memsave.last_report()
    assert (report.unknown_dim_size, report.unknown_dim_source) == (64, "memsave.batch_size(64)")


def _tanh_step_planned_for_512(weights, spec, **kwargs):
    """(the report, the graph) of a step of tanh layers of `weights` traced for `spec`
    inside memsave.batch_size(512), its gradients memsave's with `kwargs`."""
    def loss_of(x):
        h = x
        for w in weights:
            h = tf.tanh(h @ w)
        return tf.reduce_sum(h ** 2)

    @tf.function(input_signature=[spec])
    def step(x):
        return memsave.gradients(loss_of(x), weights, **kwargs)
    with memsave.batch_size(512):
        graph = step.get_concrete_function().graph
    return memsave.last_report(), graph


def _unknown_and_static_batch(**kwargs):
    """_tanh_step_planned_for_512 of 12 layers of 256 for a batch of None, then of 512."""
    weights = [tf.Variable(tf.random.normal([256, 256], seed=i) * 0.06) for i in range(12)]
    return [_tanh_step_planned_for_512(weights, tf.TensorSpec([batch, 256]), **kwargs)
            for batch in (None, 512)]


def test_a_plan_for_a_batch_prices_its_recomputation_as_the_static_batch_would():
    # The cost model and the report's recomputed bytes size unknown dimensions as the
    # planned batch too: counted as 1, the per-op overhead made a segment of [batch, 256]
    # tanh layers look like 1.6 forward passes, and its bytes 0.06 MiB instead of 132.
    (unknown, _), (static, _) = _unknown_and_static_batch(checkpoints=memsave.budget(0.85))
    assert unknown.unknown_dim_size == 512 and static.unknown_dims == 0
    assert unknown.recompute_flops == static.recompute_flops > 0
    assert unknown.forward_flops == static.forward_flops
    assert unknown.recomputed_bytes == static.recomputed_bytes > 0
    assert [c.name for c in unknown.checkpoints] == [c.name for c in static.checkpoints]


def test_a_plan_for_a_batch_orders_and_offloads_as_the_static_batch_would():
    # The rewrite sized the tensors of a step traced with a batch of None as a batch of 1
    # where it decides which gradient ops run one after another and which checkpoints
    # are large enough to offload: under fit, 'memory' had no ordering edges at all, and
    # offload's min_bytes saw checkpoints 512 times too small.
    def edges(graph):
        return sum(len(op.control_inputs) for op in graph.get_operations())

    for kwargs in ({"checkpoints": "memory"},
                   {"checkpoints": "memory", "offload": memsave.Offload("/CPU:0",
                                                                        min_bytes=2 ** 18)}):
        (unknown, unknown_graph), (static, static_graph) = _unknown_and_static_batch(**kwargs)
        unknown_edges, static_edges = edges(unknown_graph), edges(static_graph)
        assert unknown.orders_backward and static.orders_backward
        assert unknown_edges == static_edges > 0
        assert unknown.offloaded == static.offloaded
        assert unknown.offload_moved_bytes == static.offload_moved_bytes
    assert static.offloaded and static.offload_moved_bytes >= 2 * 2 ** 19


def test_batch_size_names_a_bad_value_and_nests():
    for bad in (0, -3, 2.5, "8", True):
        with pytest.raises(memsave.MemsaveError, match=r"batch_size is .*; pass a positive int"):
            with memsave.batch_size(bad):
                pass
    with memsave.batch_size(8):
        with memsave.batch_size(4):
            assert batch_lib.current() == (4, "memsave.batch_size(4)")
        assert batch_lib.current() == (8, "memsave.batch_size(8)")
    assert batch_lib.current() is None


def test_fit_batch_size_reads_arrays_and_nests_of_them():
    x = {"a": np.zeros((50, 3)), "b": np.zeros((50, 2))}
    assert keras_batch.fit_batch_size(x, 16) == (16, "fit's batch_size=16")
    assert keras_batch.fit_batch_size(x, 64, validation_split=0.2)[0] == 40
    assert keras_batch.fit_batch_size(iter([1, 2])) is None
