"""Loops (issue 28): a while_v2 loop's gradient through a copy that recomputes its body.

TensorFlow's gradient of a `tf.while_loop` keeps, from every iteration, what the body's
gradient reads (an LSTM step's gates and activations). memsave differentiates instead a
copy of the loop, run in the backward pass, whose gradient recomputes each iteration's
stateless ops from the iteration's inputs (memsave.graph.loops). Every case compares
memsave with tf.gradients in float64 in one graph, in both graph kinds, and checks what
the copy keeps per iteration.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import environment, planner
from memsave.graph import _tf_private, loops
from memsave.inputs import normalise_call
from memsave.planner import costs
from memsave.planner.loops import loop_memory
from memsave.region import ForwardRegion

from _gradcheck import assert_same_gradients, clipped_square, evaluate

STEPS, BATCH, WIDTH = 6, 4, 5
RNG = np.random.RandomState(3)
X_SEQ = RNG.uniform(-1, 1, [STEPS, BATCH, WIDTH])
W0 = RNG.standard_normal([WIDTH, WIDTH]) / 2
U0 = RNG.standard_normal([WIDTH, WIDTH]) / 2


def _rnn(x_seq, w, u, cell=None):
    """A tanh RNN over the first axis of x_seq, written as users write loops; `cell`
    (h, x) -> h replaces its step."""
    steps = x_seq.shape[0]
    cell = cell or (lambda h, x: tf.tanh(tf.matmul(x, w) + tf.matmul(h, u)) * 1.5)

    def body(i, h, total):
        h = cell(h, x_seq[i])
        return i + 1, h, total + tf.reduce_sum(h * h)

    h0 = tf.zeros([BATCH, WIDTH], tf.float64)
    _, h, total = tf.while_loop(lambda i, h, total: i < steps, body,
                                [tf.constant(0), h0, tf.constant(0.0, tf.float64)],
                                maximum_iterations=steps)
    return tf.reduce_sum(tf.sin(h)) + total


def _run(kind, make_loss, checkpoints="memory", before=None, loop_mode="always", chunk="auto"):
    """(tf.gradients' values, memsave's, memsave's report, the graph) for the loss
    `make_loss(x_seq, w, u)` with respect to w and u (variables) in one graph of `kind`,
    under memsave.recompute_loops(loop_mode) (these loops are too small for 'auto' to
    recompute). `before(loss, xs)`: called first (e.g. an earlier tf.gradients of the
    same loop)."""
    reports, graphs = [], []
    variables = {}
    if kind == "function":  # (made inside, they would make tf.function trace twice)
        variables.update(w=tf.Variable(W0, name="w"), u=tf.Variable(U0, name="u"))

    def body(graph, inputs):
        if not variables:
            variables["w"] = tf.Variable(W0, name="w")
            variables["u"] = tf.Variable(U0, name="u")
        w, u = variables["w"], variables["u"]
        loss = make_loss(inputs["x"], w, u)
        xs = [_tf_private.graph_tensor_of_variable(v, graph) for v in (w, u)]
        if before is not None:
            before(loss, xs)
        expected = tf.gradients(loss, xs)
        with memsave.always_rewrite(), memsave.recompute_loops(loop_mode, chunk=chunk):
            got = memsave.gradients(loss, xs, checkpoints=checkpoints)
        reports.append(memsave.last_report())
        graphs.append(graph)
        return {"tf": [tf.convert_to_tensor(g) for g in expected],
                "memsave": [tf.convert_to_tensor(g) for g in got]}

    values = evaluate(kind, body, {"x": X_SEQ})
    return values["tf"], values["memsave"], reports[-1], graphs[-1]


def _copies(graph, gradient="memsave_"):
    """The recomputing copies memsave built in `graph` (loops whose body has the
    IdentityN that recomputes the core, or a chunk, in the gradient; `gradient`: the
    prefix of its gradient's name: 'memsave_recompute_gradient' for a copy without
    chunks, 'memsave_chunk_gradient' for one with)."""
    found = []
    for op in graph.get_operations():
        body = getattr(op, "_body_graph", None) if loops.is_loop(op) else None
        if body is not None and any(
                (_tf_private.overridden_gradient_type(o) or "").startswith(gradient)
                for o in body.get_operations()):
            found.append(op)
    return found


def _pushed(loop):
    """The op types of what a differentiated loop pushes onto its accumulators."""
    return sorted(op.inputs[1].op.type for op in loop._body_graph.get_operations()
                  if op.type == "TensorListPushBack")


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_loop_is_differentiated_through_a_recomputing_copy(kind):
    expected, got, report, graph = _run(kind, _rnn)
    assert_same_gradients(expected, got, rtol=1e-12)
    copies = _copies(graph)
    assert len(copies) == 1
    # The copy keeps each iteration's carry and input slice, not its activations: the
    # loop's own gradient pushes the tanh outputs too.
    pushed = _pushed(copies[0])
    assert "Tanh" not in pushed and "Mul" not in pushed, pushed
    assert set(pushed) <= {"Placeholder", "StridedSlice", "Shape"}, pushed
    assert [why.split(" ")[0] for _, why in report.loops] == ["recomputed"]
    assert "1 loop recomputed in the backward pass" in report.summary()


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_loop_with_a_custom_gradient_is_kept_and_its_gradient_called_once(kind):
    """A tf.custom_gradient's function reads the tensors its closure holds, the loop's
    own: a copy of the loop could not use it."""
    calls = []
    clip = clipped_square(calls.append, 0.5)

    def loss(x_seq, w, u):
        return _rnn(x_seq, w, u, cell=lambda h, x: tf.tanh(clip(tf.matmul(x, w)) + h @ u))

    expected, got, report, graph = _run(kind, loss)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert not _copies(graph)
    (_, why), = report.loops
    assert "custom gradient" in why, why
    # tf.gradients builds the loop's gradient once, and so does memsave.
    assert len(calls) == 2, calls


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_loop_drawing_random_numbers_is_kept_as_tensorflow_builds_it(kind):
    def loss(x_seq, w, u):
        return _rnn(x_seq, w, u, cell=lambda h, x: tf.nn.dropout(
            tf.tanh(x @ w + h @ u), rate=0.25, seed=7))

    expected, got, report, graph = _run(kind, loss)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert not _copies(graph)
    (name, why), = report.loops
    assert why.startswith("kept as TensorFlow differentiates it") and "Random" in why, why


def test_a_loop_tf_gradients_differentiated_first_is_exact():
    """tf.gradients rewrote the loop to push its activations; the copy reads the rewritten
    body and stays exact."""
    expected, got, _, graph = _run("v1", _rnn, before=lambda loss, xs: tf.gradients(loss, xs))
    assert_same_gradients(expected, got, rtol=1e-12)
    assert len(_copies(graph)) == 1


@pytest.mark.parametrize("checkpoints", ["speed", "collection", memsave.budget(0.9)])
def test_every_strategy_is_exact_with_a_loop(checkpoints):
    expected, got, report, graph = _run("function", _rnn, checkpoints=checkpoints)
    assert_same_gradients(expected, got, rtol=1e-12)
    # (With no checkpoint, 'collection' here, plain tf.gradients answers: no copy.)
    assert len(_copies(graph)) == (report.fallback is None), report.summary()


def test_under_xla_a_loop_is_differentiated_as_it_is():
    w, u = tf.Variable(W0), tf.Variable(U0)

    @tf.function(jit_compile=True, autograph=False)
    def step(x_seq):
        loss = _rnn(x_seq, w, u)
        with memsave.always_rewrite(), memsave.recompute_loops():
            return tf.gradients(loss, [w, u]), memsave.gradients(loss, [w, u],
                                                                  checkpoints="memory")

    expected, got = step(tf.constant(X_SEQ))
    assert_same_gradients([g.numpy() for g in expected], [g.numpy() for g in got], rtol=1e-12)
    # XLA drops the control inputs that would hold a copy back to the backward pass.
    (_, why), = memsave.last_report().loops
    assert "under XLA" in why, why


def test_the_model_counts_what_each_iteration_keeps():
    """tf.gradients keeps, per iteration, the matmuls' inputs x_t and h (for the weights'
    gradients), tanh's output, and what the Mul and the sum read; the copy keeps the
    carry and the slice only."""
    graph = tf.Graph()
    with graph.as_default():
        x_seq = tf.constant(X_SEQ)
        w = tf.Variable(W0)
        u = tf.Variable(U0)
        _rnn(x_seq, w, u)
        loop, = [op for op in graph.get_operations() if loops.is_loop(op)]
        memory = loop_memory(loop)
    block = BATCH * WIDTH * 8
    assert memory.iterations == STEPS and memory.known
    # x_t, h (matmul inputs), tanh's output, the product h*1.5 (read by h*h) per step.
    assert memory.kept_by_tensorflow == STEPS * 4 * block, memory
    # The copy: per step the carry (two int32 counters, h, the float64 total), not the
    # input slice (a slice of a loop invariant, recomputed); its outputs but those it
    # passes on unchanged (the counters, h, the total; not the maximum or the sequence it
    # slices); one iteration's recomputation.
    carry = 2 * 4 + block + 8
    outputs = carry
    assert memory.kept_by_copy == STEPS * carry + outputs + 4 * block, memory
    assert memory.why_kept is None


def test_under_a_limit_the_gradient_loop_is_counted_running_its_whole_parallel_iterations_ahead():
    """Each iteration of the gradient loop makes a weight-sized product the running sum
    takes in turn: how many it holds at once depends on how far ahead the executor runs
    (a Keras LSTM stack: one kernel gradient, or 32 of them). The model counts half of
    parallel_iterations, and all of them where the step must fit a limit
    (memsave.capacity, Environment.holds_a_limit)."""
    graph = tf.Graph()
    with graph.as_default():
        _, _, loop = _weight_reading_loop()
        middle, top = loop_memory(loop), loop_memory(loop, whole_run_ahead=True)
        compiled = loop_memory(loop, under_xla=True)
    product = 64 * 64 * 8  # (the weight's gradient, per iteration)
    parallel = min(loop.get_attr("parallel_iterations"), STEPS)
    # (the other half of parallel_iterations, each iteration's product at least: the
    # products of what the body reads from outside, less what an iteration frees)
    assert (top.gradient_run_ahead - middle.gradient_run_ahead
            >= (parallel - parallel // 2) * product > 0), (middle, top)
    assert environment.Environment(allocator=environment.ONE_REGION).holds_a_limit
    assert not environment.Environment(allocator=environment.CPU_GROWING).holds_a_limit
    # The range the report gives runs from none of the iterations ahead to all of them.
    least, most = middle.gradient_run_ahead_span
    assert least < middle.gradient_run_ahead < most == top.gradient_run_ahead, middle
    assert (middle.run_ahead(), middle.run_ahead(0), middle.run_ahead(1)) == (
        middle.gradient_run_ahead, least, most)
    assert middle.run_ahead_varies
    # (XLA's compiled loop runs one iteration after another: no range)
    assert compiled.gradient_run_ahead_span is None and not compiled.run_ahead_varies


def _weight_reading_loop():
    """(loss, the weight, the loop op) of a loop whose every iteration reads a 64 x 64
    float64 weight: its gradient loop makes a weight-sized product per iteration."""
    x_seq = tf.constant(RNG.uniform(-1, 1, [STEPS, 1, 64]))
    w = tf.Variable(RNG.standard_normal([64, 64]) / 8)

    def body(i, h):
        return i + 1, tf.tanh(tf.matmul(x_seq[i], w) + h)
    _, h = tf.while_loop(lambda i, h: i < STEPS, body,
                         [tf.constant(0), tf.zeros([1, 64], tf.float64)],
                         maximum_iterations=STEPS)
    loop, = [op for op in tf.compat.v1.get_default_graph().get_operations()
             if loops.is_loop(op)]
    return tf.reduce_sum(h * h), w, loop


# One FLOP per element, no overheads: a loop's price is its ops' work alone.
_PLAIN_PRICES = costs.Costs(per_element=1.0, per_normalised_element=1.0, op_overhead=0,
                              segment_overhead=0)


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_loop_is_priced_by_its_iterations_and_its_copy_by_what_it_runs_again(chunk):
    """The forward pass runs the body every iteration; the recomputing copy runs the loop
    again, a chunked copy's gradient each chunk once more, and the gradient loop the core
    again every iteration; each iteration of a gradient loop adds the weight's gradient
    to its running sum. (Priced as one op, the LSTM benchmark's two loops were 0.0 of its
    recomputation and its step predicted at 1.00x tf.gradients' time; measured, 1.47x.)"""
    graph = tf.Graph()
    with graph.as_default():
        loss, w, loop = _weight_reading_loop()
        memory = loop_memory(loop, chunk=chunk, costs=_PLAIN_PRICES)
        with costs.use(_PLAIN_PRICES), memsave.recompute_loops("always", chunk=chunk):
            recomputed = memsave.plan(loss, [w], "memory")
        with costs.use(_PLAIN_PRICES), memsave.recompute_loops("never"):
            kept = memsave.plan(loss, [w], "memory")
        with costs.use(_PLAIN_PRICES), memsave.recompute_loops("always", chunk=chunk):
            timed = memsave.plan(loss, [w], memsave.budget(time=1.2))
    matmul = 2 * 64 * 64  # (x_t [1, 64] times w [64, 64], per iteration)
    # The body: the matmul, the add, the tanh and the slice of x_seq, and scalars.
    assert matmul + 3 * 64 <= memory.body_cost <= matmul + 3 * 64 + 16, memory
    assert matmul + 2 * 64 <= memory.core_cost <= memory.body_cost, memory
    assert memory.forward_cost == STEPS * memory.body_cost
    runs = 2 if chunk > 1 else 1
    assert memory.chunk == chunk
    assert memory.recompute_cost == STEPS * (runs * memory.body_cost + memory.core_cost)
    # A weight-sized add per iteration (and one of x_seq's size, read from outside too).
    assert 64 * 64 <= memory.sums_cost <= 64 * 64 + STEPS * 64, memory
    for report in (recomputed, kept):
        assert memory.forward_cost <= report.forward_flops < memory.forward_cost + 2 * matmul
        assert report.loop_sums_flops == STEPS * memory.sums_cost, report
    assert (recomputed.recompute_flops - kept.recompute_flops == memory.recompute_cost
            ), (recomputed.recompute_flops, kept.recompute_flops)
    step = 3 * recomputed.forward_flops + recomputed.loop_sums_flops
    assert recomputed.step_time_ratio == pytest.approx(1 + recomputed.recompute_flops / step)
    assert recomputed.step_time_ratio > 1.3, recomputed.step_time_ratio
    # A time budget counts the copy's runs: no plan recomputing the loop is within 1.2x.
    assert "no plan within 1.2x" in (timed.fallback or ""), timed.summary()


@pytest.mark.parametrize("loop_mode", ["never", "always"])
def test_the_report_gives_the_peak_as_a_range_where_tensorflow_runs_a_gradient_loop(loop_mode):
    """How far the executor runs a gradient loop ahead varies from process to process
    (plain Keras' LSTM stack: 87-90 or 131-136 MiB), so the report gives tf.gradients'
    peak, and a plan's where TensorFlow differentiates a loop of it, as (least, most)
    around the counted prediction; a plan whose copies differentiate every loop has no
    range, and neither has a step without loops."""
    graph = tf.Graph()
    with graph.as_default():
        loss, w, _ = _weight_reading_loop()
        with memsave.recompute_loops(loop_mode):
            report = memsave.plan(loss, [w], "memory")
        least, most = report.baseline_peak_range
        assert least < report.baseline_peak_bytes < most, report
        if loop_mode == "always":
            assert report.predicted_peak_range is None, report
        else:
            least, most = report.predicted_peak_range
            assert least < report.predicted_peak_bytes < most, report
        assert "as far ahead as TensorFlow runs its gradient loops" in report.summary()
        plain = memsave.plan(tf.reduce_sum(tf.tanh(tf.matmul(w, w))), [w], "memory")
    assert plain.baseline_peak_range is None and plain.predicted_peak_range is None


def _rnn_writing_a_list(x_seq, w):
    """A tanh RNN over `x_seq` read from a TensorArray, writing each h to another: the
    TensorArray it wrote."""
    inputs = tf.TensorArray(tf.float64, size=STEPS).unstack(x_seq)
    outputs = tf.TensorArray(tf.float64, size=STEPS, element_shape=[BATCH, WIDTH])

    def body(i, h, written):
        h = tf.tanh(tf.matmul(inputs.read(i), w) + h)
        return i + 1, h, written.write(i, h)

    _, _, written = tf.while_loop(lambda i, h, written: i < STEPS, body,
                                  [tf.constant(0), tf.zeros([BATCH, WIDTH], tf.float64),
                                   outputs])
    return written


def test_the_model_counts_tensor_lists_as_their_elements():
    """A TensorList made from a tensor holds one buffer per element (the allocator
    replay places each apart: `pieces`); a reserved one holds nothing until the loop
    writes it, and the loop's output list holds what it wrote. The carries the copy
    keeps are one buffer per iteration too."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(W0)
        loss = tf.reduce_sum(_rnn_writing_a_list(tf.constant(X_SEQ), w).stack())
        call = normalise_call([loss], [w])
        step = planner.model_of(ForwardRegion.build(call.ys, call.xs)).graph
    block = BATCH * WIDTH * 8
    lists = {t.name: (t.op.type, step.size[tid], step.pieces.get(tid, 1))
             for tid, t in enumerate(step.tensors) if t.dtype == tf.variant}
    by_type = {}
    for kind, nbytes, pieces in lists.values():
        by_type.setdefault(kind, []).append((nbytes, pieces))
    assert by_type["TensorListFromTensor"] == [(STEPS * block, STEPS)]
    assert by_type["TensorListReserve"] == [(0, 1)]
    # The list the loop wrote (read by the stack after it):
    stacked, = [op for op in graph.get_operations() if op.type == "TensorListStack"]
    source = stacked.inputs[0]
    while source.op.type == "Identity":
        source = source.op.inputs[0]
    assert source.op.type == "While"
    assert lists[source.name][1:] == (STEPS * block, STEPS), lists
    loop, = step.loops.values()
    assert loop.carries == STEPS and loop.carried > 0, loop


def test_a_tensor_lists_gradient_is_counted_to_what_made_the_list():
    """The gradient of a TensorList is a list of its elements' gradients: it goes back
    through the loop that read the list to what made it (an RNN's input sequence, the
    layer before), one buffer per element. The model once sent none through a
    TensorList, and the gradients between two Keras LSTMs (four of 29.7 MiB at batch
    304) were missing from max_batch_size's predictions."""
    graph = tf.Graph()
    with graph.as_default():
        v = tf.Variable(RNG.standard_normal([WIDTH, WIDTH]))
        w = tf.Variable(W0)
        x_seq = tf.reshape(tf.matmul(tf.reshape(X_SEQ, [-1, WIDTH]), v), [STEPS, BATCH, WIDTH])
        written = _rnn_writing_a_list(x_seq, w)
        call = normalise_call([tf.reduce_sum(written.stack())], [w, v])
        step = planner.model_of(ForwardRegion.build(call.ys, call.xs)).graph
    block = BATCH * WIDTH * 8

    def gradients_of(op_type):
        op, = [i for i, op in enumerate(step.ops) if op.type == op_type]
        return [(step.tensors[tid].dtype, nbytes, step.grad_pieces.get(tid, 1))
                for tid, nbytes in step.grad_inputs[op]]
    sequence = (tf.variant, STEPS * block, STEPS)
    assert gradients_of("TensorListStack") == [sequence]   # (the list the loop wrote)
    assert sequence in gradients_of("While")                # (the list it read)
    assert gradients_of("TensorListFromTensor") == [(tf.float64, STEPS * block, 1)]
    assert gradients_of("MatMul") == [(tf.float64, WIDTH * WIDTH * 8, 1)]  # (v's value)


@pytest.mark.parametrize("batch", [BATCH, None])
def test_an_item_written_to_a_tensor_list_is_not_kept_per_iteration(batch):
    """A TensorList write's gradient reads the index and only the item's shape, which the
    loop's gradient computes in the forward loop: the RNN's h written to its output
    sequence is not kept (a Keras LSTM's h: 6.25 MiB per layer on the LSTM benchmark),
    unless the graph does not know that shape whole (a batch of None): then it is."""
    graph = tf.Graph()
    with graph.as_default():
        x_seq = tf.compat.v1.placeholder_with_default(X_SEQ, [STEPS, batch, WIDTH])
        w = tf.Variable(W0)
        outputs = tf.TensorArray(tf.float64, size=STEPS, element_shape=[batch, WIDTH])

        def body(i, h, written):
            h = tf.tanh(tf.matmul(x_seq[i], w) + h) * 1.5
            return i + 1, h, written.write(i, h)

        _, _, written = tf.while_loop(lambda i, h, written: i < STEPS, body,
                                      [tf.constant(0), tf.zeros_like(x_seq[0]), outputs],
                                      maximum_iterations=STEPS)
        loss = tf.reduce_sum(written.stack())
        loop, = [op for op in graph.get_operations() if loops.is_loop(op)]
        memory = loop_memory(loop, unknown_dim_size=BATCH)
        tf.gradients(loss, [w])
        differentiated, = [op for op in graph.get_operations() if loops.is_loop(op)
                           and "grad" not in op.name]
    block = BATCH * WIDTH * 8
    # x_t (the weight's gradient reads it) and tanh's output, and the index the write's
    # gradient reads; the written product only where its shape is not known.
    written_kept = batch is None
    assert memory.kept_by_tensorflow == STEPS * ((2 + written_kept) * block + 4), memory
    # What TensorFlow keeps: the same floating tensors (and the weight's value, which
    # shares the variable's buffer).
    kept = [op.inputs[1] for op in differentiated._body_graph.get_operations()
            if op.type == "TensorListPushBack" and op.inputs[1].dtype == tf.float64
            and op.inputs[1].op.type != "ReadVariableOp"]
    assert sorted(t.op.type for t in kept) == sorted(
        ["StridedSlice", "Tanh"] + ["Mul"] * written_kept), kept


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_loop_without_a_maximum_reading_tensors_from_outside(kind):
    """No maximum_iterations: the condition reads only the user's counter, yet the copy
    must count its iterations (TensorFlow's gradient runs as many); and a tensor the body
    reads from outside (a loop invariant) gets its gradient summed over iterations."""
    def body(graph, inputs):
        a, b = inputs["a"], inputs["b"]
        _, c = tf.while_loop(lambda i, c: i < 3,
                             lambda i, c: (i + 1, tf.tanh(0.9 * c + 0.1 * b)), [0, a])
        loss = tf.reduce_sum(tf.sigmoid(c) * tf.sin(a))
        expected = tf.gradients(loss, [a, b])
        with memsave.always_rewrite(), memsave.recompute_loops():
            got = memsave.gradients(loss, [a, b], checkpoints="memory")
        assert len(_copies(graph)) == 1
        return {"tf": expected, "memsave": got}

    values = evaluate(kind, body, {"a": X_SEQ[0], "b": X_SEQ[1]})
    assert_same_gradients(values["tf"], values["memsave"], rtol=1e-12)


def test_auto_recomputes_a_loop_only_where_its_copy_holds_less():
    """A loop of one step: its copy would hold its outputs and one iteration's
    recomputation besides the carry, more than TensorFlow keeps; kept as TensorFlow
    differentiates it under 'auto' and 'never'."""
    def one_step(x_seq, w, u):
        _, h = tf.while_loop(lambda i, h: i < 1, lambda i, h: (i + 1, tf.tanh(h @ w)),
                             [0, x_seq[0]])
        return tf.reduce_sum(h * u[0, 0])

    for mode in ("auto", "never"):
        expected, got, report, graph = _run("v1", one_step, loop_mode=mode)
        assert_same_gradients(expected, got, rtol=1e-12)
        assert not _copies(graph)
        (_, why), = report.loops
        assert why.startswith("kept as TensorFlow differentiates it"), why
        assert ("copy would hold more" if mode == "auto" else "'never'") in why, why


def test_auto_recomputes_a_long_loop():
    """The same cell over 200 steps of a wider batch: TensorFlow keeps 4 tensors a step,
    the copy 1 (h) and a few scalars."""
    steps = 200
    graph = tf.Graph()
    with graph.as_default():
        x_seq = tf.constant(np.tile(X_SEQ[:1], [steps, 1, 1]))
        w, u = tf.Variable(W0), tf.Variable(U0)
        loss = _rnn(x_seq, w, u)
        report = memsave.plan(loss, [w.handle, u.handle], checkpoints="memory")
    (_, why), = report.loops
    assert why.startswith("recomputed in the backward pass (200 iterations, in chunks of 14)"), why


def test_an_unknown_loop_mode_is_refused():
    with pytest.raises(memsave.MemsaveError, match="unknown recompute_loops mode 'sometimes'; "
                       "expected one of 'auto', 'always', 'never' \\(or None\\)"):
        with memsave.recompute_loops("sometimes"):
            pass


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_loop_whose_output_is_in_stop_gradients_is_differentiated_as_it_is(kind):
    """tf.gradients sends no gradient back through a stop_gradients tensor (here the
    identity tf.while_loop returns; fuzz seed 843 stops the loop's own output too)."""
    def body(graph, inputs):
        a, b = inputs["a"], inputs["b"]
        _, c = tf.while_loop(lambda i, c: i < 3, lambda i, c: (i + 1, tf.tanh(c * b)), [0, a])
        loss = tf.reduce_sum(c) + tf.reduce_sum(tf.sin(b))
        expected = tf.gradients(loss, [a, b], stop_gradients=[c])
        with memsave.always_rewrite(), memsave.recompute_loops():
            got = memsave.gradients(loss, [a, b], checkpoints="memory", stop_gradients=[c])
        return {"tf": [tf.zeros_like(a) if g is None else g for g in expected],
                "memsave": [tf.zeros_like(a) if g is None else g for g in got],
                "none": [tf.constant(g is None) for g in expected + got]}

    values = evaluate(kind, body, {"a": X_SEQ[0], "b": X_SEQ[1]})
    assert_same_gradients(values["tf"], values["memsave"], rtol=1e-12)
    assert list(values["none"][:2]) == list(values["none"][2:])


def _nested_loop(x_seq, w, u):
    def body(i, h):
        _, h = tf.while_loop(lambda j, h: j < 2, lambda j, h: (j + 1, tf.tanh(h @ u)), [0, h])
        return i + 1, tf.sin(x_seq[i] @ w + h)
    _, h = tf.while_loop(lambda i, h: i < STEPS, body, [0, tf.zeros([BATCH, WIDTH], tf.float64)],
                         maximum_iterations=STEPS)
    return tf.reduce_sum(h * h)


def _cond_in_body(x_seq, w, u):
    def body(i, h):
        h = tf.cond(tf.equal(i % 2, 0), lambda: tf.tanh(h @ u), lambda: tf.sin(h @ w))
        return i + 1, h + x_seq[i]
    _, h = tf.while_loop(lambda i, h: i < STEPS, body, [0, tf.zeros([BATCH, WIDTH], tf.float64)],
                         maximum_iterations=STEPS)
    return tf.reduce_sum(h * h)


@pytest.mark.parametrize("make_loss", [_nested_loop, _cond_in_body])
@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_loop_running_functions_of_its_own_is_differentiated_as_it_is(kind, make_loss):
    """A copy would run the same library functions (an inner loop's, a cond's branches):
    TensorFlow's gradients of the loop and of its copy would both rewrite them under the
    same names. tf.gradients differentiates the loop first here, as a user's earlier
    call would."""
    expected, got, report, graph = _run(kind, make_loss)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert not _copies(graph)
    outer = [why for name, why in report.loops if "nested loop, conditional" in why]
    assert outer, report.loops


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_gather_in_the_body_keeps_its_gradient_exact(kind):
    """An embedding-style gather of a table the loop reads: its gradient comes out of the
    recomputation in the gradient loop."""
    table = RNG.standard_normal([10, WIDTH])

    def loss(x_seq, w, u):
        ids = tf.constant([[1, 3, 3, 7], [0, 9, 2, 2], [5, 5, 5, 1], [8, 0, 4, 6], [2, 2, 9, 3],
                           [7, 1, 0, 4]])
        rows = tf.constant(table) * w[0, 0]
        return _rnn(x_seq, w, u, cell=lambda h, x: tf.tanh(x @ w + h @ u) + tf.gather(
            rows, ids[0]))

    expected, got, _, graph = _run(kind, loss)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert len(_copies(graph)) == 1


def test_a_copy_leaves_the_variables_it_reads_read_only():
    """A second memsave call in the same graph recomputes the loop again: the first call's
    copy reads the loop's variables, it does not write them (TensorFlow would mark a
    handle passed through the copy's IdentityN as written)."""
    graph = tf.Graph()
    with graph.as_default():
        w, u = tf.Variable(W0), tf.Variable(U0)
        loss = _rnn(tf.constant(X_SEQ), w, u)
        with memsave.always_rewrite(), memsave.recompute_loops():
            memsave.gradients(loss, [w.handle, u.handle], checkpoints="memory")
            first = memsave.last_report().loops
            memsave.gradients(loss, [w.handle, u.handle], checkpoints="memory")
            second = memsave.last_report().loops
        assert len(_copies(graph)) == 2
    assert first[0][1].startswith("recomputed") and second[0][1].startswith("recomputed"), second


# Chunks (memsave.recompute_loops(chunk=)): the copy keeps the carry where each chunk
# starts and recomputes the chunk in the backward pass (STEPS = 6: chunks of 4 leave a
# last chunk of 2; 7 is one chunk, longer than the loop).
@pytest.mark.parametrize("kind", ["v1", "function"])
@pytest.mark.parametrize("chunk", [2, 4, 7])
def test_a_chunked_copy_is_exact(kind, chunk):
    expected, got, report, graph = _run(kind, _rnn, chunk=chunk)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert len(_copies(graph, "memsave_chunk_gradient")) == 1
    (_, why), = report.loops
    assert f"in chunks of {min(chunk, STEPS)}" in why, why


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_chunked_copy_of_a_loop_its_condition_stops_early(kind):
    """The condition ends the loop inside a chunk (after 5 of at most 9 iterations, a
    count the data decides: the sum passes 22 in the fifth; 2+2+1 and 3+2): the copy
    runs no iteration more than the loop."""
    def stops_early(x_seq, w, u):
        def body(i, h, total):
            h = tf.tanh(tf.matmul(x_seq[i % STEPS], w) + tf.matmul(h, u))
            return i + 1, h, total + tf.reduce_sum(h * h)

        h0 = tf.zeros([BATCH, WIDTH], tf.float64)
        _, h, total = tf.while_loop(
            lambda i, h, total: tf.logical_and(i < 9, total < 22.0 + 0.0 * w[0, 0]), body,
            [tf.constant(0), h0, tf.constant(0.0, tf.float64)], maximum_iterations=9)
        return tf.reduce_sum(tf.sin(h)) + total

    for chunk in (2, 3):
        expected, got, _, graph = _run(kind, stops_early, chunk=chunk)
        assert_same_gradients(expected, got, rtol=1e-12)
        assert len(_copies(graph, "memsave_chunk_gradient")) == 1


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_chunked_copy_of_a_loop_without_a_maximum(kind):
    def no_maximum(x_seq, w, u):
        _, h = tf.while_loop(lambda i, h: i < STEPS,
                             lambda i, h: (i + 1, tf.tanh(x_seq[i] @ w + h @ u)),
                             [0, tf.zeros([BATCH, WIDTH], tf.float64)])
        return tf.reduce_sum(h * h)

    for chunk in (4, 8):  # (the count unknown, 8 is not cut to it)
        expected, got, report, graph = _run(kind, no_maximum, chunk=chunk)
        assert_same_gradients(expected, got, rtol=1e-12)
        assert len(_copies(graph, "memsave_chunk_gradient")) == 1
        assert f"in chunks of {chunk}" in report.loops[0][1], report.loops


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_chunked_copy_of_a_loop_that_runs_no_iteration(kind):
    def never_runs(x_seq, w, u):
        _, h = tf.while_loop(lambda i, h: i < tf.reduce_sum(x_seq) * 0.0 - 1.0,
                             lambda i, h: (i + 1.0, tf.tanh(h @ w + h @ u)),
                             [tf.constant(0.0, tf.float64), x_seq[0] @ w])
        return tf.reduce_sum(h * h)

    expected, got, _, graph = _run(kind, never_runs, chunk=2)
    assert_same_gradients(expected, got, rtol=1e-12)
    assert len(_copies(graph, "memsave_chunk_gradient")) == 1


def _nested_loops(graph):
    """The loops in the bodies of `graph`'s loops, at any depth."""
    found = []
    for op in graph.get_operations():
        body = getattr(op, "_body_graph", None) if loops.is_loop(op) else None
        if body is not None:
            inner = [o for o in body.get_operations() if loops.is_loop(o)]
            found += inner + _nested_loops(body)
    return found


def test_a_chunked_copy_keeps_a_carry_per_chunk_and_recomputes_the_chunk():
    """The copy's gradient pushes, per chunk, the loop variables (its body's inputs,
    passed on by the IdentityN), never an activation; the chunk's loop in the copy keeps
    nothing (nothing differentiates it); the chunk runs again in the copy's gradient
    loop, and that run, differentiated, keeps each iteration's carry."""
    _, _, _, graph = _run("v1", _rnn, chunk=3)
    copy, = _copies(graph, "memsave_chunk_gradient")
    pushed = _pushed(copy)
    assert pushed and set(pushed) <= {"Placeholder", "IdentityN"}, pushed
    chunk_loop, = [op for op in copy._body_graph.get_operations() if loops.is_loop(op)]
    assert not _pushed(chunk_loop)
    reruns = [op for op in _nested_loops(graph)
              if op is not chunk_loop and op.graph is not copy._body_graph and _pushed(op)]
    assert reruns and all(set(_pushed(op)) <= {"Placeholder", "StridedSlice", "Shape"}
                          for op in reruns), [_pushed(op) for op in reruns]


def test_auto_chunks_long_loops_only():
    """'auto': chunks of about sqrt(T) where the graph says T, T >= 16 and the carries
    are most of what the copy holds; the model counts the carries a chunked copy holds."""
    from memsave.planner.loops import carries_kept, chunk_for
    assert chunk_for(200, True, carries=9, lists=4) == 14
    assert chunk_for(100, True, carries=1) == 10
    # Not where the lists the loop reads and writes are half its carries or more.
    assert chunk_for(200, True, carries=8, lists=4) == 1
    assert chunk_for(15, True, carries=1) == 1 and chunk_for(200, False, carries=1) == 1
    assert chunk_for(200, True, 1) == 1 and chunk_for(6, True, 7) == 6
    assert carries_kept(100, 1) == 100 and carries_kept(100, 10) == 20
    assert carries_kept(6, 4) == 2 + 4
    graph = tf.Graph()
    with graph.as_default():
        x_seq = tf.constant(np.tile(X_SEQ[:1], [100, 1, 1]))
        _rnn(x_seq, tf.Variable(W0), tf.Variable(U0))
        loop, = [op for op in graph.get_operations() if loops.is_loop(op)]
        chunked, whole = loop_memory(loop), loop_memory(loop, chunk=1)
    assert chunked.chunk == 10 and whole.chunk == 1
    carry = 2 * 4 + BATCH * WIDTH * 8 + 8
    assert whole.kept_by_copy - chunked.kept_by_copy == (100 - 20) * carry


@pytest.mark.parametrize("chunk", [0, -2, 2.5, True, "sqrt"])
def test_a_bad_chunk_is_refused(chunk):
    with pytest.raises(memsave.MemsaveError, match=f"recompute_loops chunk {chunk!r} is not "
                       "'auto' or a positive int"):
        with memsave.recompute_loops("auto", chunk=chunk):
            pass


def test_a_mode_set_inside_leaves_the_chunk_set_outside():
    from memsave import rewrite
    with memsave.recompute_loops(None, chunk=3):
        with memsave.recompute_loops("always"):
            assert (rewrite._loop_mode(), rewrite._loop_chunk()) == ("always", 3)
        assert rewrite._loop_chunk() == 3
    assert rewrite._loop_chunk() == "auto"


def test_tf_while_loops_may_run_in_chunks():
    """The counter of a loop tf.while_loop builds only counts (why_not_in_chunks)."""
    graph = tf.Graph()
    with graph.as_default():
        _rnn(tf.constant(X_SEQ), tf.Variable(W0), tf.Variable(U0))
        loop, = [op for op in graph.get_operations() if loops.is_loop(op)]
        assert loops.why_not_in_chunks(loop) is None
