"""memsave.gradients equals tf.gradients, for every strategy, in both graph kinds,
and really recomputes (counted), each region op once per segment."""

import dataclasses
import gc
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import planner, strategies
from memsave.graph import _tf_private
from memsave.region import ForwardRegion

import _models

STRATEGIES = ["memory", "speed", "collection", "every_third"]


def _evaluate(kind, build):
    """Runs `build()` in a graph of `kind`; returns its fetches as numpy."""
    _models.reset_variables()
    if kind == "v1":
        graph = tf.Graph()
        with graph.as_default():
            fetches = build()
            with tf.compat.v1.Session(graph=graph) as session:
                session.run(tf.compat.v1.global_variables_initializer())
                return session.run(fetches)
    result = tf.function(build, autograph=False)()
    return tf.nest.map_structure(lambda t: t.numpy(), result)


def _as_dense(values):
    if hasattr(values, "indices") and hasattr(values, "dense_shape"):
        dense = np.zeros(values.dense_shape, values.values.dtype)
        np.add.at(dense, values.indices, values.values)
        return dense
    return np.asarray(values)


def assert_same_gradients(expected, got, rtol=1e-5):
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        if e is None:
            assert g is None, f"gradient {i}: tf.gradients gives None, memsave does not"
            continue
        e, g = _as_dense(e), _as_dense(g)
        scale = max(np.max(np.abs(e)), 1e-30)
        error = np.max(np.abs(e - g)) / scale
        assert error <= rtol, f"gradient {i}: relative error {error:.3g}"


def _none_safe(pair):
    expected, got = pair
    keep = [i for i, e in enumerate(expected) if e is not None]
    return [expected[i] for i in keep], [got[i] for i in keep], [i for i, g in enumerate(got) if g is None]


@pytest.mark.parametrize("kind", ["v1", "function"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model", sorted(_models.MODELS))
def test_gradients_equal_tf_gradients(kind, strategy, model):
    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", memsave.MemsaveWarning)
            expected, got = _models.both_gradients(model, strategy)
        connected = [i for i, e in enumerate(expected) if e is not None]
        unconnected = [i for i, e in enumerate(expected) if e is None]
        for i in unconnected:
            assert got[i] is None, f"x {i} is unconnected: memsave must give None"
        return [expected[i] for i in connected], [got[i] for i in connected]

    expected, got = _evaluate(kind, build)
    assert_same_gradients(expected, got)


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_unconnected_zero(kind):
    def build():
        ys, xs, _ = _models.unconnected_xs()
        got = memsave.gradients(ys, xs, checkpoints="memory", unconnected_gradients="zero")
        return got[-1]

    np.testing.assert_array_equal(_evaluate(kind, build), np.zeros([3], np.float32))


_COPY_NAME = re.compile(r"^memsave(_\d+)?/[^/]+/recompute/")


def _count_copies(graph):
    """The recomputed copies (not their gradient ops) in `graph`."""
    return [op for op in graph.get_operations() if _COPY_NAME.match(op.name)]


@pytest.mark.parametrize("strategy", ["memory", "every_third", "speed"])
def test_recomputation_happens_once_per_region_op(strategy):
    graph = tf.Graph()
    with graph.as_default():
        ys, xs, _ = _models.tanh_chain(n=30)
        region = ForwardRegion.build(ys, xs)
        checkpoints = _models._every_third_op_output(ys, xs) if strategy == "every_third" else strategy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", memsave.MemsaveWarning)
            memsave.gradients(ys, xs, checkpoints=checkpoints)
        report = memsave.last_report()
        copies = _count_copies(graph)
    if report.fallback:  # 'speed' finds no matmul/conv in a tanh chain: nothing recomputed
        assert strategy == "speed" and not copies
        return
    # On a chain every region op lies in exactly one segment: copied exactly once.
    assert len(copies) == len(region) == report.copied_ops
    originals = sorted(_COPY_NAME.sub("", op.name) for op in copies)
    assert originals == sorted(op.name for op in region.ops)
    assert len(report.segments) == len(report.checkpoints) + 1


def test_copies_wait_for_their_trigger():
    """Step 6: a segment's copies read nothing before their checkpoint's gradient exists."""
    graph = tf.Graph()
    with graph.as_default():
        ys, xs, _ = _models.tanh_chain(n=30)
        memsave.gradients(ys, xs, checkpoints="memory")
        copies = set(_count_copies(graph))
    roots = [op for op in copies if not any(t.op in copies for t in op.inputs)]
    # Directly, or through the segment's local inputs (identities) they read.
    assert roots and all(op.control_inputs or any(
        t.op.type == "Identity" and t.op.control_inputs for t in op.inputs) for op in roots)


def test_recomputed_casts_of_weights_wait_for_their_segment():
    """Grappler's arithmetic optimizer moves a narrowing Cast ahead of the identity it
    reads (a segment's local input: Cast(Identity(w)) becomes Identity(Cast(w))), and
    the moved Cast keeps only its own control inputs: unless it waits itself, every
    segment's bfloat16 copy of its float32 weight is made as the step starts and held
    to its segment's backward pass (Keras ResNet50 under mixed_bfloat16: 64 MiB)."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        weights = [tf.Variable(rng.standard_normal([64, 64]).astype(np.float32))
                   for _ in range(4)]
        h, marks = tf.cast(tf.ones([8, 64]), tf.bfloat16), []
        for w in weights:
            h = tf.tanh(tf.matmul(h, tf.cast(w, tf.bfloat16)) / 8.0)
            marks.append(h)
        loss = tf.reduce_sum(tf.cast(h, tf.float32) ** 2)
        with memsave.always_rewrite():
            grads = memsave.gradients(loss, weights, checkpoints=marks[:-1])
        # (the graph as it runs: after Grappler)
        options = tf.compat.v1.RunOptions(output_partition_graphs=True)
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(grads, options=options, run_metadata=metadata)
    casts = [node for partition in metadata.partition_graphs for node in partition.node
             if node.op == "Cast" and "/recompute/" in node.name]
    assert len(casts) >= 3, [node.name for node in casts]
    # Each waits for its segment's trigger itself (a control input), or reads a copy
    # that does; none reads a variable alone.
    unwaiting = [node.name for node in casts if not any(
        name.startswith("^") or "/recompute/" in name or "/input" in name
        for name in node.input)]
    assert not unwaiting, unwaiting


@pytest.mark.parametrize("kind", ["v1", "function"])
def test_a_checkpoint_made_by_a_widening_cast_is_held_as_its_input(kind):
    """A checkpoint cast from a narrower type, read by two segments: each casts the
    narrower input again, nothing memsave adds reads the wider tensor (so it is freed
    after the forward pass), and the gradients equal tf.gradients' (float64)."""
    def build():
        x = tf.constant(np.random.RandomState(0).standard_normal([32, 32]))
        narrow = tf.cast(tf.tanh(x), tf.float32)
        wide = tf.cast(narrow, tf.float64)
        kept = tf.sin(wide)
        loss = tf.reduce_sum((tf.cos(kept) * wide) ** 2)
        expected = tf.gradients(loss, [x])
        before = set(tf.compat.v1.get_default_graph().get_operations())
        with memsave.always_rewrite():
            got = memsave.gradients(loss, [x], checkpoints=[wide, kept])
        assert [op.name for op in wide.consumers() if op not in before] == []
        casts = [op for op in tf.compat.v1.get_default_graph().get_operations()
                 if op.type == "Cast" and re.fullmatch(r"memsave/\w+/narrowed_input", op.name)]
        assert len(casts) == 2
        (info,) = [c for c in memsave.last_report().checkpoints if c.name == wide.name]
        assert "held as the Cast's float32 input" in info.reason and info.bytes == 32 * 32 * 4
        return expected, got

    expected, got = _evaluate(kind, build)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12)


def test_grappler_fuses_recomputed_batch_norms_with_their_relus():
    """The copies wait through their local inputs, not through control inputs of their
    own, which would stop Grappler's remapper fusing a batch norm with its ReLU (with
    oneDNN: two kernels instead of one, and no ReLU mask for the third reserve space)."""
    _models.reset_variables()
    graph = tf.Graph()
    with graph.as_default():
        # (each batch norm reads its scale, an x, through the segment's local input)
        loss, xs, blocks = _conv_bn_relu_chain(blocks=3, scale_shift=None)
        expected = tf.gradients(loss, xs)
        got = memsave.gradients(loss, xs, checkpoints=[conv for conv, _ in blocks])
        copies = _count_copies(graph)
        norms = [op for op in copies if op.type == "FusedBatchNormV3"]
        assert len(norms) == 3 and not any(op.control_inputs for op in norms)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            expected = session.run(expected)
            got = session.run(got, options=options, run_metadata=metadata)
    kernels = {node.node_name: node.timeline_label.split(" = ")[-1].split("(")[0]
               for device in metadata.step_stats.dev_stats for node in device.node_stats}
    run = sorted(kernels[op.name] for op in copies if op.name in kernels)
    if _tf_private.onednn_enabled():
        # (the last block's is read from the forward pass: its copy never runs)
        assert run == ["_MklNativeFusedBatchNormEx"] * 2
    assert_same_gradients(expected, got)


def test_custom_gradients_read_the_segments_copies():
    """A tf.custom_gradient's closure reads the forward pass's tensors (tf.nn.silu's, its
    input): the segments' gradients read the copies instead, so the forward pass keeps
    only the checkpoints, and the gradients are tf.gradients'. (The last segment, the
    last silu, is read from the forward pass: its input is a checkpoint.)"""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
        h, outs = x, []
        for _ in range(8):
            h = tf.nn.silu(h)
            outs.append(h)
        loss = tf.reduce_sum(h)
        expected = tf.gradients(loss, [x])
        forward = set(graph.get_operations())
        made_before = len(graph.get_operations())
        got = memsave.gradients(loss, [x], checkpoints=[outs[3], outs[6]])
        added = graph.get_operations()[made_before:]
        read = {t.name for op in added for t in op.inputs
                if t.op in forward and t.dtype.is_floating and t.shape.num_elements() != 1}
        assert read == {x.name, outs[3].name, outs[6].name}
        value = np.random.RandomState(0).standard_normal([64, 64]).astype(np.float32)
        with tf.compat.v1.Session(graph=graph) as session:
            expected, got = session.run([expected, got], {x: value})
    assert_same_gradients(expected, got)


def test_memory_strategy_is_deterministic():
    def rewritten_graph_def():
        _models.reset_variables()
        graph = tf.Graph()
        with graph.as_default():
            ys, xs, _ = _models.deep_mlp(n=6)
            memsave.gradients(ys, xs, checkpoints="memory")
        return graph.as_graph_def()

    first, second = rewritten_graph_def(), rewritten_graph_def()
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)


def test_xs_may_be_variables_in_both_graph_kinds():
    def build():
        v = _models._var([2, 2], 0, 1.0)
        h = v
        for _ in range(6):
            h = tf.tanh(h) * 2.0
        loss = tf.reduce_sum(h)
        return tf.gradients(loss, [v]), memsave.gradients(loss, [v], checkpoints="memory")

    for kind in ("v1", "function"):
        expected, got = _evaluate(kind, build)
        assert_same_gradients(expected, got)


def test_sparse_gradients_stay_indexed_slices():
    graph = tf.Graph()
    with graph.as_default():
        table = tf.Variable(np.ones([1000, 8], np.float32))
        h = tf.gather(table, [1, 5, 7])
        for _ in range(6):
            h = tf.tanh(h)
        loss = tf.reduce_sum(h)
        (expected,) = tf.gradients(loss, [table])
        (got,) = memsave.gradients(loss, [table], checkpoints="memory")
        assert isinstance(expected, tf.IndexedSlices)
        assert isinstance(got, tf.IndexedSlices)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            e, g = session.run([tf.convert_to_tensor(expected), tf.convert_to_tensor(got)])
    np.testing.assert_allclose(g, e, rtol=1e-6)


def _residual_stream(blocks=24, width=8):
    """x_{k+1} = x_k + tanh(x_k @ w_k), a skip every 4 blocks, marks after skip-adds."""
    x = _models._const([4, width], 8)
    weights, skip, h = [], x, x
    for i in range(blocks):
        w = _models._const([width, width], 100 + i, 0.3)
        weights.append(w)
        h = h + tf.tanh(tf.matmul(h, w))
        if i % 4 == 3:
            h, skip = h + skip, h
            memsave.mark_checkpoint(h)
    return tf.reduce_sum(h * h), [x] + weights


@pytest.mark.parametrize("strategy", ["speed", "collection"])
def test_residual_stream_is_recomputed_once_not_per_segment(strategy):
    """Checkpoints that do not cut the residual stream (matmul outputs; marks after a
    skip-add) would make every segment re-walk the stream to its start (quadratic).
    Tensors read by several segments are kept too, so each region op is copied once."""
    graph = tf.Graph()
    with graph.as_default():
        loss, xs = _residual_stream()
        region = ForwardRegion.build([loss], xs)
        got = memsave.gradients(loss, xs, checkpoints=strategy)
        report = memsave.last_report()
        copies = _count_copies(graph)
        expected = tf.gradients(loss, xs)
        with tf.compat.v1.Session() as session:
            expected, got = session.run([expected, got])
    assert len(copies) == report.copied_ops <= len(region)
    assert any("several segments" in c.reason for c in report.checkpoints)
    assert_same_gradients(expected, got)


@pytest.mark.parametrize("collector_on", [True, False])
def test_the_cycle_collector_is_off_while_building_and_as_it_was_after(collector_on):
    """Building a large step allocates many long-lived objects; memsave pauses Python's
    cycle collector while it plans and rewrites, and restores the caller's setting after
    success and failure alike (the caller's own gc.disable() is kept)."""
    seen = []

    def recording(region):
        seen.append(gc.isenabled())
        return "memory"

    def failing(region):
        seen.append(gc.isenabled())
        raise RuntimeError("strategy failed")

    graph = tf.Graph()
    was = gc.isenabled()
    try:
        (gc.enable if collector_on else gc.disable)()
        with graph.as_default():
            ys, xs, _ = _models.tanh_chain(n=30)
            memsave.gradients(ys, xs, checkpoints=lambda region: recording(region) and [])
            assert gc.isenabled() == collector_on
            with pytest.raises(RuntimeError, match="strategy failed"):
                memsave.gradients(ys, xs, checkpoints=failing)
            assert gc.isenabled() == collector_on
            memsave.plan(ys, xs, checkpoints=lambda region: recording(region) and [])
            assert gc.isenabled() == collector_on
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False, False]


def _conv_bn_relu_chain(blocks=2, channels=8, activation=tf.nn.relu, scale_shift=1.0,
                        conv_head=False):
    """`blocks` times conv -> fused batch norm -> `activation`, on variables (nothing
    folds), the batch norm's scale `scale_shift` + a variable (None: the variable
    itself), then with `conv_head` a 1x1 convolution; returns the loss, the xs and each
    block's (convolution output, activation output)."""
    read = tf.convert_to_tensor  # each variable read once: the xs are those reads
    h = read(_models._var([4, 32, 32, channels], 40, 1.0))
    xs, blocks_out = [h], []
    for i in range(blocks):
        kernel = read(_models._var([3, 3, channels, channels], 41 + i, 0.2))
        scale = read(_models._var([channels], 51 + i, 0.1))
        conv = tf.nn.conv2d(h, kernel, strides=1, padding="SAME")
        shifted = scale if scale_shift is None else scale + scale_shift
        normed, _, _ = tf.compat.v1.nn.fused_batch_norm(conv, shifted, tf.zeros([channels]),
                                                       epsilon=1e-3, is_training=True)
        h = activation(normed)
        xs += [kernel, scale]
        blocks_out.append((conv, h))
    if conv_head:
        kernel = read(_models._var([1, 1, channels, channels], 61, 0.2))
        xs.append(kernel)
        h = tf.nn.conv2d(h, kernel, strides=1, padding="SAME")
    return tf.reduce_sum(h * h), xs, blocks_out


def _copies_run(session, fetches):
    """The original names of the recomputed copies that running `fetches` executes."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    values = session.run(fetches, options=options, run_metadata=metadata)
    names = {node.node_name for device in metadata.step_stats.dev_stats
             for node in device.node_stats}
    return values, sorted(_COPY_NAME.sub("", n) for n in names if _COPY_NAME.match(n))


@pytest.mark.parametrize("activation", [tf.nn.relu, tf.tanh], ids=["relu", "tanh"])
@pytest.mark.parametrize("dropped", [(), ("activation", 0)],
                         ids=["all kept", "first activation dropped"])
def test_gradients_read_kept_and_small_tensors_from_the_forward_pass(dropped, activation):
    """A segment's gradients read its checkpoint, and tensors too small to recompute (a
    batch norm's saved mean and variance), as the forward pass made them: a ReLU's
    gradient reads its kept output, so its copy never runs (here reading costs no
    memory, so the plan reads: a 1x1 convolution heads the loss, whose input gradient
    writes into no buffer the activation frees; under `h * h` it would, where the
    activation is recomputed rather than kept). A batch norm's copy still runs where its
    third reserve space is the mask of the ReLU Grappler fuses it with
    (kernels.onednn_cpu.workspace_bytes: half a byte per element), not where it is empty
    (read by a Tanh). The copies that do run are the ones the memory model predicts
    (Segmentation.executed), and the gradients are tf.gradients'."""
    _models.reset_variables()
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, blocks = _conv_bn_relu_chain(activation=activation, conv_head=True)
        checkpoints = [conv for conv, _ in blocks] + [
            out for i, (_, out) in enumerate(blocks) if dropped != ("activation", i)]
        expected = tf.gradients(loss, xs)
        got = memsave.gradients(loss, xs, checkpoints=checkpoints)
        assert memsave.last_report().reads_checkpoints
        assert memsave.last_report().reads_last_segment
        step_graph = planner.StepGraph.build(ForwardRegion.build([loss], xs))
        segmentation = planner.Segmentation(step_graph,
                                            [step_graph.id_of(t) for t in checkpoints],
                                            read_checkpoints=True, read_last_segment=True)
        predicted = sorted(step_graph.ops[op].name for head in segmentation.order
                           for op in segmentation.executed(head))
        # Grappler off, so that what runs is what the graph says.
        config = tf.compat.v1.ConfigProto()
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            expected = session.run(expected)
            got, run = _copies_run(session, got)
    assert run == predicted
    types = sorted(graph.get_operation_by_name(name).type for name in run)
    # Never a kept activation or a block's convolution. A batch norm, and its scale, for
    # its ReLU mask, or for the dropped activation's input; not the head's convolution,
    # whose output the last segment's product gradient reads from the forward pass.
    fused = activation is tf.nn.relu and _tf_private.onednn_enabled()
    norms = 2 if fused else (1 if dropped else 0)
    activations = ["Relu" if activation is tf.nn.relu else "Tanh"] * bool(dropped)
    assert types == sorted(["AddV2"] * norms + ["FusedBatchNormV3"] * norms + activations)
    assert_same_gradients(expected, got)


def _tanh_thirds(ahead):
    """x -> 12 tanh -> sum, and a strategy keeping the 4th and 8th tanh outputs that
    recomputes ahead or not (as memsave.budget decides: a Selection's hint)."""
    x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
    h, outs = x, []
    for _ in range(12):
        h = tf.tanh(h)
        outs.append(h)

    def thirds(region):
        return memsave.strategies.Selection([outs[3], outs[7]], recompute_ahead=ahead)
    return tf.reduce_sum(h), x, thirds


@pytest.mark.parametrize("ahead", [False, True], ids=["in turn", "ahead"])
def test_segments_recompute_ahead_where_the_plan_says(ahead):
    """A segment's copies wait (through the control inputs of its input identities) for
    the gradient of the checkpoint it ends at; recomputing ahead, for the gradient the
    segment after it waits for, so they can run beside that segment's backward pass.
    The gradients are tf.gradients' either way."""
    with tf.Graph().as_default() as graph, memsave.always_rewrite():
        loss, x, thirds = _tanh_thirds(ahead)
        expected = tf.gradients(loss, [x])
        got = memsave.gradients(loss, [x], checkpoints=thirds)
        assert memsave.last_report().recomputes_ahead == ahead
        assert ("each a segment ahead" in memsave.last_report().summary()) == ahead
        waits = {op.name.split("/")[1]: [c.name for c in op.control_inputs]
                 for op in graph.get_operations() if op.control_inputs}
        value = np.random.default_rng(0).normal(size=[64, 64]).astype(np.float32)
        with tf.compat.v1.Session(graph=graph) as session:
            expected, got = session.run([expected, got], {x: value})
    last_gradient = ["memsave/last_segment/gradients/memsave/last_segment/recompute/"
                     "Tanh_8_grad/TanhGrad"]
    middle_gradient = ["memsave/segment_7/gradients/memsave/segment_7/recompute/"
                       "Tanh_4_grad/TanhGrad"]
    assert waits == {"last_segment": ["Sum"],
                     "segment_7": ["Sum"] if ahead else last_gradient,
                     "segment_3": last_gradient if ahead else middle_gradient}
    assert_same_gradients(expected, got)


@pytest.mark.parametrize("ahead", [False, True], ids=["in turn", "ahead"])
def test_a_segments_copies_wait_for_the_whole_backward_pass_of_the_segment_before(ahead):
    """Beside the gradient they read, a segment's copies wait for every gradient of the
    segment built before (its weight gradients too), through one NoOp, as the memory
    model has it: waiting for the gradient alone, an executor recomputed the next
    segment while a weight gradient still held the segment's activation (a budget's
    plan measured 59.0-67.5 MiB for 54.5 predicted). Recomputing ahead, the copies wait
    for the segment before the one before."""
    rng = np.random.default_rng(0)
    with tf.Graph().as_default() as graph, memsave.always_rewrite():
        x = tf.compat.v1.placeholder(tf.float64, [64, 32])
        weights = [tf.Variable(rng.standard_normal([32, 32]) / 6) for _ in range(9)]
        h, outs = x, []
        for w in weights:
            h = tf.tanh(h @ w)
            outs.append(h)
        loss = tf.reduce_sum(h)
        expected = tf.gradients(loss, weights)
        got = memsave.gradients(loss, weights, checkpoints=lambda region: (
            memsave.strategies.Selection([outs[2], outs[5]], recompute_ahead=ahead)))
        assert memsave.last_report().recomputes_ahead == ahead
        done = [op for op in graph.get_operations()
                if op.type == "NoOp" and "previous_backward_done" in op.name]
        waiting = [[op for op in graph.get_operations() if noop in op.control_inputs]
                   for noop in done]
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            expected, got = session.run([expected, got], {x: rng.standard_normal([64, 32])})
    # One per segment built after another: each waits for that segment's three weight
    # gradients and its input's gradient.
    assert len(done) == 2
    assert [sum(c.type == "MatMul" for c in noop.control_inputs) for noop in done] == [4, 4]
    # In turn, each NoOp holds back the next segment's copies (their input identities);
    # ahead, the first holds back the segment after next and the second none.
    assert [len(w) > 0 for w in waiting] == ([True, True] if not ahead else [True, False])
    assert all(op.type == "Identity" for w in waiting for op in w)
    assert_same_gradients(expected, got, rtol=1e-12)


@pytest.mark.parametrize("checkpoints", ["memory", "conv outputs", "conv and relu outputs"])
def test_plan_predicts_the_segments_and_the_copies_the_rewrite_runs(checkpoints, monkeypatch):
    """memsave.plan (which builds nothing) counts the segments and the copies that will
    run as the rewrite then builds them (report.segments, recomputed_ops). (Planned for
    oneDNN's kernels: with TensorFlow's own, the conv-and-relu list's plan recomputes
    nothing, and the test would show nothing.)"""
    monkeypatch.setattr(_tf_private, "onednn_enabled", lambda: True)
    _models.reset_variables()
    with tf.Graph().as_default(), memsave.always_rewrite():
        loss, xs, blocks = _conv_bn_relu_chain(blocks=3)
        if checkpoints != "memory":
            checkpoints = [conv for conv, _ in blocks] + (
                [relu for _, relu in blocks] if checkpoints == "conv and relu outputs" else [])
        planned = memsave.plan(loss, xs, checkpoints)
        memsave.gradients(loss, xs, checkpoints=checkpoints)
        built = memsave.last_report()
    assert planned.reads_checkpoints == built.reads_checkpoints
    assert planned.predicted_segments == len(built.segments) > 1
    assert planned.predicted_recomputed_ops == built.recomputed_ops > 0
    assert f"{len(built.segments)} segments would recompute {built.recomputed_ops} ops" in (
        planned.summary())


@pytest.mark.parametrize("model,ordered", [(lambda: _models.deep_mlp(batch=256), True),
                                           (_models.small_cnn, False)])
def test_tensorflows_own_kernels_order_the_backward_pass_where_no_convolution_is_copied(
        model, ordered, monkeypatch):
    """With TensorFlow's own CPU kernels (oneDNN off, as on CPUs without AVX-512) each
    copied convolution's input gradient waits for its filter gradient, and a chain of
    the large gradient ops in the order they were made could close a cycle with those
    edges: 'memory' orders the backward pass only where no Conv2D is copied."""
    monkeypatch.setattr(_tf_private, "onednn_enabled", lambda: False)
    _models.reset_variables()
    with tf.Graph().as_default():
        ys, xs, _ = model()
        with memsave.always_rewrite():
            memsave.gradients(ys, xs, checkpoints="memory")
        assert memsave.last_report().orders_backward == ordered


def test_memory_runs_each_segments_large_gradient_ops_one_after_another(monkeypatch):
    """'memory' makes each large gradient op of a segment (a large output, or a large
    tensor read) wait for the one tf.gradients made before it (report.orders_backward;
    within one gradient function, last made first): an executor running two side by
    side holds both where the model holds one (MobileNetV2's 'memory' peak moved
    between 79 and 115 MB with one plan). A list of the same checkpoints adds no such
    waits; no op nothing needs gets a control output (TensorFlow would then run it: the mean side of a batch
    norm's SquaredDifference gradient, a Neg); the gradients are tf.gradients'. (Planned
    for oneDNN's kernels: with TensorFlow's own, a convolution's two gradients are
    ordered pairwise instead, test_tensorflows_own_kernels_order_...)"""
    monkeypatch.setattr(_tf_private, "onednn_enabled", lambda: True)

    def rewrite(checkpoints):
        _models.reset_variables()
        graph = tf.Graph()
        with graph.as_default():
            ys, xs, _ = _models.small_cnn(blocks=6, channels=2)
            made_before = len(graph.get_operations())
            with memsave.always_rewrite():
                expected = tf.gradients(ys, xs)
                got = memsave.gradients(ys, xs, checkpoints=checkpoints)
            report = memsave.last_report()
            edges = {(c.name, op.name) for op in graph.get_operations()[made_before:]
                     for c in op.control_inputs}
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                values = session.run((expected, got))
        return graph, report, edges, values

    graph, report, ordered, values = rewrite("memory")
    _, listed, unordered, _ = rewrite([c.name for c in report.checkpoints])
    assert report.orders_backward and not listed.orders_backward
    assert_same_gradients(*values)
    chain = ordered - unordered
    assert len(chain) >= 6  # (at least one per batch norm)
    ops = {name: graph.get_operation_by_name(name) for edge in chain for name in edge}
    for earlier, later in chain:
        # (in the order they were made, but ops of one gradient function last made first:
        # test_memory_runs_a_matmuls_kernel_gradient_before_its_input_gradient)
        one_function = earlier.rpartition("/")[0] == later.rpartition("/")[0]
        assert (_tf_private.creation_index(ops[earlier])
                < _tf_private.creation_index(ops[later]) or one_function), (earlier, later)
    waiting = [later for _, later in chain]
    assert len(waiting) == len(set(waiting))  # one wait each: a chain, not a fan
    assert not [name for name in ops if ops[name].type == "Neg"]
    # Ops with small outputs that read a large tensor wait their turn too: a filter
    # gradient holds the convolution's input until it runs (a U-Net's recomputed 16 MiB
    # concatenation, alive beside the slices of its gradient where the executor ran
    # those first: 'memory' peaks of 73.5-103.5 MiB over a hundred steps, 79.5 in
    # every step once ordered).
    # (Two channels: a filter gradient's output is under 1/16 of the largest tensor.
    # The first convolution's reads the step's input image, which is not recomputed.)
    filter_grads = {op.name for op in graph.get_operations()
                    if op.type == "Conv2DBackpropFilter" and "segment" in op.name
                    and "/Conv2D_grad/" not in op.name}
    assert filter_grads and filter_grads <= set(ops), sorted(filter_grads - set(ops))


@pytest.mark.parametrize("batch,ordered", [(16, False), (256, True)])
def test_memory_orders_only_gradient_ops_that_could_move_its_peak(batch, ordered, monkeypatch):
    """'memory' orders a segment's gradient ops only where they hold at least 3% of its
    predicted peak (and 1/16 of the largest tensor: report.ordered_bytes): such an op
    run beside another, or after the next segment's copies, holds at most its own
    tensors beside what the model holds. The order costs a CPU step time (the default
    CNN, whose largest tensor is 2.8% of its peak: 1.37x ordered, 1.31x not, peaks 69.7
    and 70.7 MiB; AMD EPYC with AVX-512). A deep MLP of batch 16, whose 32x32 weights
    outweigh each 16x32 activation, has no op that large: its step gets no control
    edge the same plan without the order does not; at batch 256 it does. The gradients
    are tf.gradients'."""
    monkeypatch.setattr(_tf_private, "onednn_enabled", lambda: True)

    def rewrite(checkpoints):
        _models.reset_variables()
        graph = tf.Graph()
        with graph.as_default():
            ys, xs, _ = _models.deep_mlp(n=9, batch=batch)
            made_before = len(graph.get_operations())
            with memsave.always_rewrite():
                expected = tf.gradients(ys, xs)
                got = memsave.gradients(ys, xs, checkpoints=checkpoints)
            edges = sum(len(op.control_inputs) for op in graph.get_operations()[made_before:])
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                assert_same_gradients(*session.run((expected, got)))
        return memsave.last_report(), edges

    def unordered(problem):  # ('memory''s plan without the order)
        chosen = strategies.selection_of(strategies.STRATEGIES["memory"](problem))
        return dataclasses.replace(chosen, order_backward=False)

    report, edges = rewrite("memory")
    plain, plain_edges = rewrite(unordered)
    assert [c.name for c in plain.checkpoints] == [c.name for c in report.checkpoints]
    assert len(report.segments) > 1
    assert report.orders_backward == ordered and not plain.orders_backward
    activation = batch * 32 * 4  # (float32)
    if ordered:
        assert report.ordered_bytes == max(activation // 16,
                                           int(0.03 * report.predicted_peak_bytes))
        assert activation >= report.ordered_bytes and edges > plain_edges
        assert "one after another" in report.summary()
    else:
        assert activation < 0.03 * report.predicted_peak_bytes
        assert report.ordered_bytes == 0 and edges == plain_edges
        assert "one after another" not in report.summary()


def test_gradient_ops_of_copies_point_at_the_users_op():
    """TensorFlow's error messages about a gradient op name the forward op it came from
    (`_original_op`): for memsave's gradients that is the user's op, not memsave's copy,
    as with tf.gradients (TensorFlow's gradients_test checks it)."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.constant(np.ones([4, 4]))
        xw = tf.matmul(tf.constant(np.ones([4, 4])), w, name="xw")
        h = xw
        for _ in range(6):
            h = tf.tanh(h)
        with memsave.always_rewrite():
            grad, = memsave.gradients(tf.reduce_sum(h), [w], checkpoints="memory")
        assert "recompute" in grad.op.name  # (the segment's gradient of its copy of xw)
        assert grad.op._original_op is xw.op


def test_memory_runs_a_matmuls_kernel_gradient_before_its_input_gradient(monkeypatch):
    """In the order 'memory' gives a segment's large gradient ops, the ops one gradient
    function makes that do not read each other run last made first: a MatMul's kernel
    gradient before its input gradient, which the rest of the backward pass reads on
    from (the memory model runs the two as one step). Where the kernel gradient ran
    last, the next segment's copies ran beside it and the 16 MiB logits gradient it
    reads in a quarter of a Keras GPT's steps (30.5-32.0 MiB against 24.0, AMD EPYC
    with AVX-512). The gradients are tf.gradients'."""
    monkeypatch.setattr(_tf_private, "onednn_enabled", lambda: True)

    def build():
        ys, xs, _ = _models.deep_mlp(n=8, batch=256)
        with memsave.always_rewrite():
            got = memsave.gradients(ys, xs, checkpoints="memory")
        assert memsave.last_report().orders_backward
        graph = ys[0].graph
        # (Not the first layer's: no gradient of its input x is asked for.)
        pairs = [(op, graph.get_operation_by_name(op.name + "_1"))
                 for op in graph.get_operations()
                 if re.search(r"segment.*/MatMul_\d+_grad/MatMul$", op.name)]
        assert len(pairs) >= 6
        for input_gradient, kernel_gradient in pairs:
            assert kernel_gradient in input_gradient.control_inputs, input_gradient.name
        return tf.gradients(ys, xs), got

    expected, got = _evaluate("function", build)
    assert_same_gradients(expected, got)



@pytest.mark.parametrize("strategy", ["list", "memory"])
def test_the_last_segment_reads_what_the_forward_pass_made(strategy):
    """The last segment's backward pass starts as the forward pass ends: its gradients read
    the forward pass's tensors, so the vocabulary head and the loss (on GPT-2, 0.07 of the
    step when they ran again) are not recomputed, while the earlier segments still are;
    the model predicts no higher peak that way and less recomputation, and the gradients
    are tf.gradients' in float64."""
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, outs, logits = _models.language_model_head()
        expected = tf.gradients(loss, xs)
        with memsave.always_rewrite():
            got = memsave.gradients(loss, xs, checkpoints=outs[1:3] if strategy == "list"
                                    else "memory")
        report = memsave.last_report()
        assert report.reads_last_segment and report.segments[0].recomputed_ops == 0
        assert report.recomputed_ops > 0
        model = planner.model_of(ForwardRegion.build([loss], xs))
        ids = [model.graph.id_of(graph.get_tensor_by_name(c.name)) for c in report.checkpoints]
        recomputing, reading = [model.predict(ids, read_last_segment=read) for read in (False, True)]
        assert reading.peak_bytes <= recomputing.peak_bytes
        assert reading.recompute_flops < recomputing.recompute_flops
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            expected = session.run(expected)
            got, run = _copies_run(session, got)
    assert "Tanh" in {graph.get_operation_by_name(name).type for name in run}
    assert logits.op.name not in run
    assert not any(graph.get_operation_by_name(name).type == "SparseSoftmaxCrossEntropyWithLogits"
                   for name in run)
    assert_same_gradients(expected, got, rtol=1e-12)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "a call"])
def test_a_call_in_the_last_segment_is_recomputed(inline):
    """A tf.function call's gradient reads outputs TensorFlow adds to the op it is given
    (the recomputed copy), so where the last segment holds a call, its copy would run even
    if the segment's gradients read the forward pass: such a last segment is recomputed
    (the same ops inline are read from the forward pass). Exact in float64 both ways."""
    @tf.function(autograph=False)
    def head(h):
        return tf.tanh(h) * 2.0

    rng = np.random.RandomState(5)
    x = tf.constant(rng.standard_normal([256, 128]))
    w = tf.constant(rng.standard_normal([128, 128]) * 0.1)
    reads = {}

    @tf.function(autograph=False)
    def step(x, w):
        h, outs = x, []
        for _ in range(4):
            h = tf.tanh(tf.matmul(h, w))
            outs.append(h)
        loss = tf.reduce_sum(tf.tanh(h) * 2.0 if inline else head(h))
        with memsave.always_rewrite():
            got = memsave.gradients(loss, [x, w], checkpoints=[outs[1]])
        report = memsave.last_report()
        reads.update(fallback=report.fallback, last=report.reads_last_segment,
                     calls=[op.type for op in loss.graph.get_operations()
                            if op.type in ("PartitionedCall", "StatefulPartitionedCall")])
        return tf.gradients(loss, [x, w]), got

    expected, got = step(x, w)
    assert reads["fallback"] is None and bool(reads["calls"]) is not inline
    assert reads["last"] is inline
    assert_same_gradients([e.numpy() for e in expected], [g.numpy() for g in got], rtol=1e-12)
