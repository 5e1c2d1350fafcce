"""The Plan: planning adds nothing to the graph, and the builder builds exactly the Plan
it is given, one written by hand included."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import build, planning, rewrite
from memsave.environment import Environment
from memsave.planner import Problem
from memsave.planner.segments import ForwardReads, Segmentation
from memsave.region import ForwardRegion
from memsave.strategies import Choice

from _gradcheck import assert_same_gradients


def _tanh_chain(length=9):
    x = tf.compat.v1.placeholder(tf.float64, [16, 16], name="x")
    h, outputs = x, []
    for _ in range(length):
        h = tf.tanh(h)
        outputs.append(h)
    return x, outputs, tf.reduce_sum(h * h)


@pytest.mark.parametrize("strategy", ["memory", "speed", "collection", "budget"])
def test_plan_adds_no_op_to_the_graph(strategy):
    graph = tf.Graph()
    with graph.as_default():
        x, outputs, loss = _tanh_chain()
        memsave.mark_checkpoint(outputs[4])
        w = tf.Variable(np.eye(16))
        loss = loss + tf.reduce_sum(tf.matmul(outputs[-1], w))
        before = [op.name for op in graph.get_operations()]
        checkpoints = memsave.budget(0.9) if strategy == "budget" else strategy
        report = memsave.plan(loss, [x, w], checkpoints=checkpoints)
        assert report.checkpoints or report.fallback
        assert [op.name for op in graph.get_operations()] == before


def _hand_written_plan(x, outputs, loss, kept, recompute_ahead):
    """A Plan written field by field (no strategy, no search): checkpoints `kept`."""
    region = ForwardRegion.build([loss], [x])
    environment = dataclasses.replace(Environment.read(x.graph), always_rewrite=True)
    model = Problem(region, environment).model
    graph = model.graph
    ids = [graph.id_of(t) for t in kept]
    return planning.Plan(
        strategy="by hand", region=region, environment=environment, step_graph=graph,
        checkpoints=tuple(Choice(t, "written by hand") for t in kept), dropped=(),
        baseline=model.baseline(), prediction=model.predict(ids),
        recomputes_ahead=recompute_ahead,
        forward_reads=ForwardReads(graph, set(ids)), deferred=frozenset(graph.deferred_tensors),
        parts=tuple(planning._parts_in_backward_order(region, Segmentation(graph, ids), [x],
                                                      kept)))


@pytest.mark.parametrize("ahead", [False, True])
def test_the_builder_builds_a_hand_written_plan(ahead):
    graph = tf.Graph()
    with graph.as_default():
        x, outputs, loss = _tanh_chain()
        kept = [outputs[2], outputs[5]]
        plan = _hand_written_plan(x, outputs, loss, kept, recompute_ahead=ahead)
        expected = tf.gradients(loss, [x])
        before = len(graph.get_operations())
        grads, built = build.build(plan, [loss], [x], None, rewrite._Options({}))
        new_ops = graph.get_operations()[before:]
        values = tf.compat.v1.Session(graph=graph).run(
            [expected, grads], {x: np.linspace(-1, 1, 256).reshape(16, 16)})
    assert_same_gradients(*values, rtol=1e-12)
    # Three segments, ending at the checkpoints written and at the loss, built in the
    # backward pass's order; the 9 tanh ops are copied once each, the checkpoints'
    # producers too (their gradients read their outputs: ForwardReads reads none).
    assert [s.ends_at for s in built.segments] == [
        [loss.name], [outputs[5].name], [outputs[2].name]]
    copied_tanh = [op for op in new_ops if op.type == "Tanh"]
    assert len(copied_tanh) == 9
    # Recomputing ahead: the second segment's copies wait for the ys (the trigger of
    # the segment before it), not for the gradient of the checkpoint it ends at.
    second = [op for op in new_ops if op.name.startswith(f"memsave/segment_{5}/")
              and op.type == "Identity" and op.control_inputs]
    waits_for = {c.type for op in second for c in op.control_inputs}
    assert second
    if ahead:
        assert loss.op in {c for op in second for c in op.control_inputs}, waits_for
    else:
        assert loss.op not in {c for op in second for c in op.control_inputs}, waits_for


def test_a_plan_is_frozen():
    graph = tf.Graph()
    with graph.as_default():
        x, outputs, loss = _tanh_chain()
        plan = _hand_written_plan(x, outputs, loss, [outputs[3]], recompute_ahead=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.recomputes_ahead = True


def test_a_union_takes_a_planners_selection():
    """lowest_peak and budget return a Selection (choices with hints): a union of them
    with other strategies keeps their choices (and drops the hints)."""
    graph = tf.Graph()
    with graph.as_default():
        x, outputs, loss = _tanh_chain()
        memsave.mark_checkpoint(outputs[4])
        strategy = memsave.strategies.union(memsave.strategies.lowest_peak(),
                                            memsave.strategies.marked_tensors())
        report = memsave.plan(loss, [x], checkpoints=strategy)
        alone = memsave.plan(loss, [x], checkpoints="memory")
    names = [c.name for c in report.checkpoints]
    assert outputs[4].name in names
    assert {c.name for c in alone.checkpoints} <= set(names)
