"""Nested function calls (issue 28): a call of a `tf.function` is recomputed like any op
when running it again gives the same outputs, and kept otherwise.

Keras runs some layers as nested functions (ConvNeXt's grouped convolutions, compiled
with jit_compile=True), and so does any model built from `tf.function`s. Every case
compares memsave with tf.gradients in float64 in one graph, and counts the calls memsave
copied.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.graph import calls
from memsave.planner.timeline import TensorOwner

from _gradcheck import assert_same_gradients, clipped_square, is_copy, stateful_copies

RNG = np.random.RandomState(1)
W_VALUES = [RNG.standard_normal([16, 16]) / 4 for _ in range(8)]
X = RNG.standard_normal([32, 16])


def _layer(jit_compile):
    @tf.function(jit_compile=jit_compile, autograph=False)
    def layer(h, w):
        return tf.tanh(tf.matmul(h, w)) * 1.5
    return layer


def _chained(layer, weights):
    """forward(h): `layer` applied with each weight in turn."""
    def forward(h):
        for w in weights:
            h = layer(h, w)
        return h
    return forward


def _run_both(forward, weights, checkpoints="memory"):
    """tf.gradients and memsave.gradients of sum(forward(x)**2) in one tf.function;
    (expected, got, the step's graph, memsave's report)."""
    reports = []

    @tf.function(autograph=False)
    def step(x):
        y = tf.reduce_sum(forward(x) ** 2)
        expected = tf.gradients(y, weights)
        with memsave.always_rewrite():
            got = memsave.gradients(y, weights, checkpoints=checkpoints)
        reports.append(memsave.last_report())
        return expected, got

    x = tf.constant(X)
    expected, got = step(x)
    graph = step.get_concrete_function(x).graph
    return [g.numpy() for g in expected], [g.numpy() for g in got], graph, reports[-1]


def _copied_calls(graph):
    return [op for op in graph.get_operations() if is_copy(op) and calls.is_call(op)]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["plain", "jit"])
def test_calls_of_a_function_that_reads_variables_are_recomputed(jit_compile):
    weights = [tf.Variable(w) for w in W_VALUES]
    expected, got, graph, report = _run_both(_chained(_layer(jit_compile), weights), weights)
    assert_same_gradients(expected, got, rtol=1e-12)
    copied = _copied_calls(graph)
    assert copied, report.summary()  # (all calls were kept as control flow before)
    assert report.fallback is None and len(report.segments) >= 2, report.summary()
    assert not stateful_copies(graph.get_operations())


def test_a_call_copy_differentiates_through_the_same_backward_function_once():
    """tf.gradients builds a called function's backward function once (a Python
    gradient inside it runs once, however many calls); memsave's copies reuse it."""
    calls_made = []
    clip = clipped_square(calls_made.append, 0.5)

    weights = [tf.Variable(w) for w in W_VALUES[:6]]

    copied = []

    def gradients_counted(gradient_fn):
        del calls_made[:]

        @tf.function(autograph=False)
        def layer(h, w):  # (a new function per step: its backward is built per step)
            return clip(tf.tanh(tf.matmul(h, w)))

        @tf.function(autograph=False)
        def step(x):
            h = x
            for w in weights:
                h = layer(h, w)
            with memsave.always_rewrite():
                return gradient_fn(tf.reduce_sum(h * 3.0), weights)
        grads = [g.numpy() for g in step(tf.constant(X))]
        copied.extend(_copied_calls(step.get_concrete_function(tf.constant(X)).graph))
        return grads, len(calls_made)

    expected, tf_calls = gradients_counted(tf.gradients)
    got, memsave_calls = gradients_counted(
        lambda y, xs: memsave.gradients(y, xs, checkpoints="memory"))
    assert_same_gradients(expected, got, rtol=1e-12)
    assert memsave.last_report().fallback is None
    assert tf_calls == memsave_calls == 1, (tf_calls, memsave_calls)
    assert copied  # (the calls were recomputed, not kept)


def test_a_call_of_a_function_with_a_random_op_is_kept():
    weights = [tf.Variable(w) for w in W_VALUES]

    @tf.function(autograph=False)
    def noisy(h, w):
        return tf.tanh(tf.matmul(h, w)) + tf.random.uniform(tf.shape(h), dtype=h.dtype) * 1e-3

    expected, got, graph, report = _run_both(_chained(noisy, weights), weights)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert not _copied_calls(graph)
    reasons = {reason for _, reason in report_kept(report)}
    assert any("RandomUniform" in reason for reason in reasons), reasons


def test_a_call_reading_a_variable_the_step_writes_is_kept():
    """Run again after the write, the call would read the new value."""
    weights = [tf.Variable(w) for w in W_VALUES]
    scale = tf.Variable(1.0, dtype=tf.float64)

    @tf.function(autograph=False)
    def scaled(h, w):
        return tf.tanh(tf.matmul(h, w)) * scale

    def forward(h):
        for w in weights:
            h = scaled(h, w)
        scale.assign_add(1.0)  # between the forward pass and the gradients
        return h
    expected, got, graph, report = _run_both(forward, weights)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert not _copied_calls(graph), [op.name for op in _copied_calls(graph)]
    reasons = {reason for _, reason in report_kept(report)}
    assert any("writes the variable it reads" in reason for reason in reasons), reasons


def test_a_call_making_a_stop_gradient_is_kept_and_answered_as_tf_gradients():
    """tf.gradients differentiates a call whose output is in stop_gradients anyway
    (through a SymbolicGradient op); memsave keeps such a call and gives the same."""
    layer = _layer(False)
    weights = [tf.constant(w) for w in W_VALUES]

    reports = []

    @tf.function(autograph=False)
    def step(x):
        stopped = layer(x, weights[0])
        h = stopped
        for w in weights[1:]:
            h = layer(h, w)
        y = tf.reduce_sum(h * x[:, :16])
        expected = tf.gradients(y, [x], stop_gradients=[stopped])
        with memsave.always_rewrite():
            got = memsave.gradients(y, [x], checkpoints="memory", stop_gradients=[stopped])
        reports.append(memsave.last_report())
        return expected, got

    expected, got = step(tf.constant(X))
    assert_same_gradients([g.numpy() for g in expected], [g.numpy() for g in got], rtol=1e-12)
    kept = dict(reports[-1].not_recomputable)
    assert "a function call whose output is in stop_gradients" in kept.values(), kept


def test_nested_calls_in_a_v1_graph():
    layer = _layer(False)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [32, 16])
        weights = [tf.constant(w) for w in W_VALUES]
        h = x
        for w in weights:
            h = layer(h, w)
        y = tf.reduce_sum(h ** 2)
        expected = tf.gradients(y, [x] + weights)
        with memsave.always_rewrite():
            got = memsave.gradients(y, [x] + weights, checkpoints="memory")
        assert _copied_calls(graph)
        with tf.compat.v1.Session(graph=graph) as session:
            expected, got = session.run([expected, got], {x: X})
    assert_same_gradients(expected, got, rtol=1e-12)


def report_kept(report):
    """(op name, reason) of the ops memsave kept as not recomputable."""
    return report.not_recomputable


def test_calls_reading_variables_in_a_v1_graph_are_recomputed():
    """A variable's initializer writes it once, before any step: not a write of the step."""
    layer = _layer(False)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [32, 16])
        weights = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
                   for i, w in enumerate(W_VALUES)]
        h = x
        for w in weights:
            h = layer(h, w)
        y = tf.reduce_sum(h ** 2)
        expected = tf.gradients(y, weights)
        got = memsave.gradients(y, weights, checkpoints="memory")
        assert _copied_calls(graph), memsave.last_report().summary()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            expected, got = session.run([expected, got], {x: X})
    assert_same_gradients(expected, got, rtol=1e-12)


def test_a_second_gradient_call_still_recomputes_calls():
    """memsave's first call reads each variable through its own identity: that is no
    write, so a second call (another loss, a persistent tape) recomputes the calls too."""
    weights = [tf.Variable(w) for w in W_VALUES]
    layer = _layer(False)
    reports = []

    @tf.function(autograph=False)
    def step(x):
        h = x
        for w in weights:
            h = layer(h, w)
        first = memsave.gradients(tf.reduce_sum(h ** 2), weights, checkpoints="memory")
        second = memsave.gradients(tf.reduce_sum(tf.sin(h)), weights, checkpoints="memory")
        reports.append(memsave.last_report())
        expected = tf.gradients(tf.reduce_sum(tf.sin(h)), weights)
        return first, second, expected

    _, second, expected = step(tf.constant(X))
    assert_same_gradients([g.numpy() for g in expected], [g.numpy() for g in second],
                          rtol=1e-12)
    kept = [why for _, why in reports[-1].not_recomputable if "function call" in why]
    assert not kept, kept


def test_a_call_tf_gradients_differentiated_first_is_copied_as_its_inference_call():
    """tf.gradients rewrites a call it differentiates to output what its backward function
    reads; memsave's copy calls the inference function again, with its own outputs only,
    and is differentiated through the backward function tf.gradients built (cached: the
    Python gradient inside runs once in all), giving the same numbers."""
    calls_made = []
    clip = clipped_square(calls_made.append, 0.5)

    @tf.function(autograph=False)
    def layer(h, w):
        return clip(tf.tanh(tf.matmul(h, w)))

    weights = [tf.Variable(w) for w in W_VALUES[:6]]

    @tf.function(autograph=False)
    def step(x):
        y = tf.reduce_sum(_chained(layer, weights)(x) * 3.0)
        expected = tf.gradients(y, weights)
        got = memsave.gradients(y, weights, checkpoints="memory")
        return expected, got

    expected, got = step(tf.constant(X))
    assert_same_gradients([g.numpy() for g in expected], [g.numpy() for g in got], rtol=1e-12)
    copies = _copied_calls(step.get_concrete_function(tf.constant(X)).graph)
    assert copies
    assert len(calls_made) == 1  # (2 where a copy kept the rewritten call's extra outputs)


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                    reason="Keras compiles grouped convolutions with XLA on a CPU only")
def test_the_model_counts_the_dense_filters_xla_holds_for_a_grouped_convolution():
    import keras

    from memsave.planner import xla_buffers

    channels = 64
    grouped = keras.layers.Conv2D(channels, 7, padding="same", groups=channels)
    dense = keras.layers.Conv2D(channels, 3, padding="same")
    x = tf.zeros([2, 4, 4, channels])

    @tf.function
    def step(x):
        return tf.reduce_sum(dense(grouped(x)))

    graph = step.get_concrete_function(x).graph
    found = {op.name: xla_buffers.gradient_temporary_bytes(op) for op in graph.get_operations()}
    compiled = [name for name, size in found.items() if size]
    assert len(compiled) == 1 and "conv2d" in compiled[0]
    assert found[compiled[0]] == 2 * 7 * 7 * channels * channels * 4
    assert sum(found.values()) == found[compiled[0]]  # (nothing for the dense one)


def test_the_model_counts_what_a_call_keeps_for_its_gradient_and_the_variable_it_reads():
    """tf.gradients rewrites a call to also output what its backward function reads (the
    tanh's output here, [32, 16] float64); the graph shows none of it before. The
    variable the call reads is counted at its own size, not at the call's output's.
    Building the forward function to see it adds nothing to the step's graph."""
    from memsave import planner
    from memsave.inputs import normalise_call
    from memsave.region import ForwardRegion

    variable = tf.Variable(RNG.standard_normal([16, 4]))  # (its own shape: not [32, 16])
    layer = _layer(False)
    found = {}

    @tf.function(autograph=False)
    def step(x):
        h = layer(x, variable)
        call = normalise_call([tf.reduce_sum(h)], [variable])
        before = (len(h.graph.get_operations()), len(h.op.outputs))
        graph = planner.model_of(ForwardRegion.build(call.ys, call.xs)).graph
        found["held"] = dict(graph.held)
        found["call"] = graph.op_id[h.op]
        found["handle"] = graph.size[graph.id_of(h.op.inputs[1])]
        found["unchanged"] = (before, (len(h.graph.get_operations()), len(h.op.outputs)))
        return h

    step.get_concrete_function(tf.constant(X[:, :16]))
    assert found["held"] == {found["call"]: 32 * 4 * 8}  # (tanh(x @ v): [32, 4])
    assert found["handle"] == 16 * 4 * 8
    assert found["unchanged"][0] == found["unchanged"][1], found["unchanged"]


def test_a_copy_waiting_for_a_gradient_a_call_makes_waits_for_its_outputs():
    """TensorFlow inlines a call before the step runs; a control edge from the call then
    waits for its stateful ops only. A segment's copies waiting for a gradient that a
    nested function's backward call makes wait through identities of its outputs
    (measured in test_memory: 24 nested calls, 110 MiB before, as tf.gradients')."""
    weights = [tf.Variable(w) for w in W_VALUES]
    marks = []

    def forward(h):
        for i, w in enumerate(weights):
            h = _layer(False)(h, w) if i == 0 else _LAYER(h, w)
            if i % 3 == 2:
                marks.append(h)
        return h

    expected, got, graph, _ = _run_both(forward, weights, checkpoints=marks)
    assert_same_gradients(expected, got, rtol=1e-12)
    waiting = [op for op in graph.get_operations() if is_copy(op) or "memsave" in op.name]
    controls = [c for op in waiting for c in op.control_inputs]
    assert controls, "no copy waits for anything"
    # (TensorFlow's own automatic control dependencies order the reads of a variable's
    # handle after the forward calls reading it: not memsave's.)
    made_by_memsave = [c for c in controls if c.name.startswith("memsave/")]
    assert not any(calls.is_call(c) for c in made_by_memsave), [c.name for c in made_by_memsave]
    assert any(c.type == "Identity" and calls.is_call(c.inputs[0].op) for c in made_by_memsave)


_LAYER = _layer(False)


def _plus_half(h, w, b):
    return tf.tanh(tf.matmul(h, w)) + 0.5 * h


def _scaled(h, w, b):
    return tf.tanh(tf.matmul(h, w)) * 1.5


def _biased(h, w, b):
    return tf.tanh(tf.matmul(h, w) + b)


@pytest.mark.parametrize("body, released, temporaries, written_into", [
    # TanhGrad writes into the tanh (the call's output), the incoming gradient is
    # freed; the input's gradient is a new tensor.
    (_biased, [("incoming", 0)], 0, ()),
    # The incoming gradient's buffer takes 1.5 dy, which TanhGrad reads last.
    (_scaled, [("incoming", 0)], 0, ()),
    # TanhGrad writes into the held tanh, 0.5 dy into the incoming gradient, and the
    # input's gradient, their AddN, into that one: its matmul part is a temporary.
    (_plus_half, [], 1, (0,)),
])
def test_a_calls_backward_function_frees_what_it_reads_last_before_its_peak(
        body, released, temporaries, written_into):
    """What a call's backward function holds at its own peak, run inlined as TensorFlow
    runs it (24 calls of tanh(h @ w + b), 'memory', AMD EPYC with AVX-512: the
    model held the incoming gradient too, 41.5 MiB predicted against 35.9 measured)."""
    from memsave.planner import call_gradients

    layer = tf.function(body, autograph=False)
    with tf.Graph().as_default():
        h = tf.compat.v1.placeholder(tf.float64, [32, 16])
        w = tf.Variable(W_VALUES[0])
        b = tf.Variable(np.zeros(16))
        call = layer(h, w, b).op
        run = call_gradients.backward_run(call, [0, 1, 2])
    assert run is not None
    assert list(run.released) == released
    assert run.temporaries == temporaries * 32 * 16 * 8
    assert run.written_into == written_into


def test_the_model_frees_a_calls_incoming_gradient_before_its_backward_peak():
    """In tf.gradients' step of a chain of calls, the gradient each call receives ends
    the step before the call's gradient: its backward function reads it first, in
    TanhGrad, and writes into the tanh, before it makes the input's gradient."""
    from memsave import planner
    from memsave.region import ForwardRegion

    layer = tf.function(_biased, autograph=False)
    with tf.Graph().as_default():
        weights = [tf.compat.v1.placeholder(tf.float64, [16, 16]) for _ in range(4)]
        bias = tf.compat.v1.placeholder(tf.float64, [16])
        x = h = tf.compat.v1.placeholder(tf.float64, [32, 16])
        outputs = []
        for w in weights:
            h = layer(h, w, bias)
            outputs.append(h)
        model = planner.model_of(ForwardRegion.build([tf.reduce_sum(h * h)], [x] + weights))
        timeline, _ = model.simulated()
        graph = model.graph
        for out in outputs[:-1]:  # (the last one's gradient is made by the loss's)
            call = graph.producer[graph.id_of(out)]
            gradient = [b for b, owner in enumerate(timeline.owners)
                        if owner == TensorOwner(graph.id_of(out))
                        and timeline.kinds[b] == "gradients"]
            assert len(gradient) == 1, gradient
            step = timeline.labels.index(("backward", call, None))
            assert timeline.ends[gradient[0]] == step - 1, (
                timeline.labels[timeline.ends[gradient[0]]], step)


def test_held_intermediates_are_freed_only_all_together():
    """The intermediates held for a call's gradient are one buffer in the model: freed
    before the gradient's peak only where every one of them is (here the sine and the
    second product are read first, the ReLU's output, the largest, by ReluGrad last)."""
    from memsave.planner import call_gradients

    @tf.function(autograph=False)
    def body(x, w1, w2, w3):
        return tf.matmul(tf.sin(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)), w3)

    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, [64, 8])
        weights = [tf.compat.v1.placeholder(tf.float64, shape)
                   for shape in ([8, 256], [256, 4], [4, 4])]
        call = body(x, *weights).op
        run = call_gradients.backward_run(call, [0, 1, 2, 3])
        held = call_gradients.held_bytes(call)
    assert held >= 64 * 256 * 8  # (the ReLU's output among them)
    assert run is not None and ("held", 0) not in run.released, run
    assert ("incoming", 0) in run.released, run
