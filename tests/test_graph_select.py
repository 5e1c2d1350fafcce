"""Walks and filters of memsave.graph.select, in a v1 Graph and in a tf.function body."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsave import graph as ge


def names(ops_or_ts):
    return [x.name for x in ops_or_ts]


def op_names(ops):
    return sorted(op.name for op in ops)


# --- the classic graph of the SPEC -----------------------------------------------------


def test_classic_graph_counts(run_graph, classic_graph):
    def build(graph, _):
        t = classic_graph()
        ops = graph.get_operations()
        assert len(ops) == 8
        assert len(ge.filter_ops(graph, True)) == 8
        assert len(ge.filter_ops(graph, lambda op: op.type == "Const")) == 3
        assert len(ge.filter_ops(graph, lambda op: op.type == "AddV2")) == 5
        assert len(ge.filter_ops_by_type(graph, "AddV2")) == 5
        assert len(ge.filter_ops_by_type(graph, ["Const", "AddV2"])) == 8
        assert op_names(ge.filter_ops_from_regex(graph, r"^.*\b[abc]$")) == ["a", "foo/b", "foo/c"]
        assert len(ge.filter_ts(graph, True)) == 8
        assert len(ge.make_list_of_t(graph)) == 8
        assert sorted(names(ge.filter_ts_from_regex(graph, r"^.*/[fgh]:\d$"))) == [
            "foo/bar/f:0", "foo/bar/g:0", "foo/bar/h:0"]
        assert len(ge.get_name_scope_ops(graph, "foo/")) == 7
        assert len(ge.get_name_scope_ops(graph, "foo")) == 7
        assert op_names(ge.get_name_scope_ops(graph, "foo/bar")) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/bar/h"]
        # "foo/ba" is a prefix of a name, not a scope.
        assert ge.get_name_scope_ops(graph, "foo/ba") == []
        # The filters also take a list of ops instead of a graph.
        bar_ops = ge.get_name_scope_ops(graph, "foo/bar")
        assert len(ge.filter_ops_by_type(bar_ops, "AddV2")) == 4
        assert names(ge.filter_ts(bar_ops, lambda x: x.op.name.endswith("h"))) == ["foo/bar/h:0"]
        assert t["h"].op.control_inputs == [t["c"].op]
        return t["h"]

    # h = f + g = (c + d) + (c + a) = (3 + 3) + (3 + 1)
    assert run_graph(build) == pytest.approx(10.0)


def test_backward_walk(run_graph, classic_graph):
    def build(graph, _):
        t = classic_graph()
        assert op_names(ge.get_backward_walk_ops(t["h"])) == [
            "a", "foo/b", "foo/bar/f", "foo/bar/g", "foo/bar/h", "foo/c", "foo/d"]
        # Discovery order is breadth first from the seed: h, then f and g, ...
        assert names(ge.get_backward_walk_ops(t["h"].op))[:3] == [
            "foo/bar/h", "foo/bar/f", "foo/bar/g"]
        assert "foo/bar/h" not in names(ge.get_backward_walk_ops(t["h"], inclusive=False))
        assert op_names(ge.get_backward_walk_ops([t["e"], t["g"]], inclusive=False)) == [
            "a", "foo/b", "foo/c", "foo/d"]
        # Stopping at c keeps a (through g) but not b.
        assert op_names(ge.get_backward_walk_ops(t["h"], stop_at_ts=[t["c"]])) == [
            "a", "foo/bar/f", "foo/bar/g", "foo/bar/h", "foo/d"]
        # ... unless control inputs are followed: h has a control input on c.
        assert op_names(ge.get_backward_walk_ops(t["h"], stop_at_ts=[t["c"]],
                                                 control_inputs=True)) == [
            "a", "foo/b", "foo/bar/f", "foo/bar/g", "foo/bar/h", "foo/c", "foo/d"]
        within = ge.get_name_scope_ops(graph, "foo/bar")
        assert op_names(ge.get_backward_walk_ops(t["h"], within_ops=within)) == [
            "foo/bar/f", "foo/bar/g", "foo/bar/h"]
        # A seed outside within_ops is dropped.
        assert ge.get_backward_walk_ops(t["c"], within_ops=within) == []
        # Tensors and ops as seeds are the same thing.
        assert ge.get_backward_walk_ops(t["f"]) == ge.get_backward_walk_ops(t["f"].op)
        return None

    run_graph(build)


def test_forward_walk(run_graph, classic_graph):
    def build(graph, _):
        t = classic_graph()
        assert op_names(ge.get_forward_walk_ops(t["c"].op)) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/bar/h", "foo/c"]
        # A tensor seeds the walk with its consumers, not with its producer.
        assert op_names(ge.get_forward_walk_ops(t["c"])) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/bar/h"]
        assert op_names(ge.get_forward_walk_ops(t["a"].op, inclusive=False)) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/bar/h", "foo/c"]
        assert op_names(ge.get_forward_walk_ops(t["d"].op, stop_at_ts=[t["f"]])) == [
            "foo/bar/e", "foo/bar/f", "foo/d"]
        # Without data edges through f and g, h is only reached by its control input.
        assert op_names(ge.get_forward_walk_ops(t["c"].op, stop_at_ts=[t["f"], t["g"]])) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/c"]
        assert op_names(ge.get_forward_walk_ops(t["c"].op, stop_at_ts=[t["f"], t["g"]],
                                                control_outputs=True)) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/bar/h", "foo/c"]
        within = [t["c"].op, t["e"].op, t["g"].op, t["h"].op]
        assert op_names(ge.get_forward_walk_ops(t["a"].op, within_ops=within)) == []
        assert op_names(ge.get_forward_walk_ops(t["c"].op, within_ops=within)) == [
            "foo/bar/e", "foo/bar/g", "foo/bar/h", "foo/c"]
        return None

    run_graph(build)


def test_consuming_generating_topological(run_graph, classic_graph):
    def build(graph, _):
        t = classic_graph()
        assert op_names(ge.get_consuming_ops(t["c"])) == ["foo/bar/e", "foo/bar/f", "foo/bar/g"]
        assert op_names(ge.get_consuming_ops([t["a"], t["d"]])) == [
            "foo/bar/e", "foo/bar/f", "foo/bar/g", "foo/c"]
        assert names(ge.get_generating_ops([t["e"], t["e"], t["f"]])) == ["foo/bar/e", "foo/bar/f"]
        ops = list(reversed(graph.get_operations()))
        ordered = ge.topological_sort(ops)
        position = {op: i for i, op in enumerate(ordered)}
        assert len(ordered) == 8
        for op in ordered:
            for x in op.inputs:
                assert position[x.op] < position[op]
            for c in op.control_inputs:
                assert position[c] < position[op]
        # Deterministic: the same input gives the same order.
        assert ge.topological_sort(ops) == ordered
        return None

    run_graph(build)


def test_tensor_set_and_map_work_on_unhashable_tensors(run_graph):
    def build(graph, _):
        a = tf.constant([1.0, 2.0], name="a")
        b = tf.identity(a, name="b")
        if run_graph.kind == "function":
            with pytest.raises(TypeError):
                hash(a)
        ts = ge.TensorSet([a, b, a])
        assert len(ts) == 2 and a in ts and b in ts
        assert names(ts) == ["a:0", "b:0"]
        tm = ge.TensorMap([(a, 1)])
        tm[b] = 2
        tm[a] = 3
        assert tm[a] == 3 and tm.get(b) == 2 and tm.get(tf.zeros([]), "none") == "none"
        assert names(tm.keys()) == ["a:0", "b:0"]
        assert ge.tensor_key(a) == ge.tensor_key(b.op.inputs[0])
        return b

    np.testing.assert_allclose(run_graph(build), [1.0, 2.0])


def test_make_list_rejects_bad_input(run_graph):
    def build(graph, _):
        a = tf.constant(1.0, name="a")
        b = tf.constant(2.0, name="b")
        with pytest.raises(TypeError, match="expected ops"):
            ge.make_list_of_op([a], allow_tensors=False)
        assert ge.make_list_of_op([a, a.op, b]) == [a.op, b.op]
        assert ge.make_list_of_op([a, b.op], ignore_ts=True) == [b.op]
        with pytest.raises(TypeError, match="expected tensors"):
            ge.make_list_of_t([a.op])
        assert names(ge.make_list_of_t([a.op, b], allow_ops=True)) == ["a:0", "b:0"]
        assert names(ge.make_list_of_t([a, b, a], allow_duplicates=True)) == ["a:0", "b:0", "a:0"]
        with pytest.raises(TypeError):
            ge.make_list_of_op(["a"])
        with pytest.raises(TypeError):
            ge.make_list_of_t([np.float32(1.0)])
        with pytest.raises(TypeError, match="set"):
            ge.make_list_of_op({a.op, b.op})
        # Membership-only arguments take sets.
        assert op_names(ge.get_backward_walk_ops(b, within_ops={b.op})) == ["b"]
        return None

    run_graph(build)


def test_eager_tensors_are_rejected():
    with pytest.raises(TypeError, match="graph tensor"):
        ge.make_list_of_t([tf.constant(1.0)])
    with pytest.raises(TypeError, match="graph tensor"):
        ge.get_forward_walk_ops([tf.constant(1.0)])
    with pytest.raises(TypeError, match="graph tensor"):
        ge.get_backward_walk_ops(tf.constant(1.0))


# --- walks agree with brute-force reachability on random DAGs ---------------------------


def _random_dag(draw_edges, n):
    """Builds n nodes; node i reads the nodes listed in draw_edges[i] (all < i)."""
    nodes = []
    for i in range(n):
        parents = [nodes[j] for j in draw_edges[i]]
        if parents:
            nodes.append(tf.add_n(parents, name=f"n{i}") if len(parents) > 1
                         else tf.identity(parents[0], name=f"n{i}"))
        else:
            nodes.append(tf.constant(float(i), name=f"n{i}"))
    return nodes


@st.composite
def dags(draw):
    n = draw(st.integers(2, 12))
    edges = [sorted(set(draw(st.lists(st.integers(0, i - 1), max_size=3)))) if i else []
             for i in range(n)]
    seed = draw(st.integers(0, n - 1))
    return n, edges, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_walks_match_reachability(dag):
    n, edges, seed = dag
    ancestors = {seed}
    for i in reversed(range(n)):
        if i in ancestors:
            ancestors.update(edges[i])
    descendants = {seed}
    for i in range(n):
        if any(j in descendants for j in edges[i]):
            descendants.add(i)
    with tf.Graph().as_default():
        nodes = _random_dag(edges, n)
        back = ge.get_backward_walk_ops(nodes[seed])
        forward = ge.get_forward_walk_ops(nodes[seed].op)
        assert sorted(op.name for op in back) == sorted(f"n{i}" for i in ancestors)
        assert sorted(op.name for op in forward) == sorted(f"n{i}" for i in descendants)
        shuffled = [nodes[i].op for i in reversed(range(n))]
        order = [int(op.name[1:]) for op in ge.topological_sort(shuffled)]
        place = {node: k for k, node in enumerate(order)}
        assert all(place[j] < place[i] for i in range(n) for j in edges[i])
