"""memsave.planner.shapes: a step traced with a batch of None, sized by TensorFlow's shape
inference once its inputs' unknown dimensions have a size."""

import tensorflow as tf

from memsave.planner import shapes
from memsave.region import estimated_bytes


def _flattening_step():
    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.int32)])
    def step(words):
        h = tf.gather(tf.ones([1000, 32]), words)              # [batch, 64, 32]
        logits = tf.reshape(h, [-1, 32]) @ tf.ones([32, 1000])  # [batch * 64, 1000]
        return tf.reduce_sum(logits)
    return step.get_concrete_function().graph


def _tensor(graph, op_type):
    return next(op.outputs[0] for op in graph.get_operations() if op.type == op_type)


def test_what_follows_from_the_batch_is_sized_by_shape_inference():
    graph = _flattening_step()
    dims = shapes.inferred(graph.get_operations(), 8)
    assert int(dims) == 8 and isinstance(dims, int)
    logits = _tensor(graph, "MatMul")
    assert logits.shape.as_list() == [None, 1000]
    assert dims.shape_of(logits).as_list() == [512, 1000]
    assert estimated_bytes(logits, dims) == 512 * 1000 * 4
    assert estimated_bytes(logits, 8) == 8 * 1000 * 4  # (the size alone: what it was)
    gathered = _tensor(graph, "GatherV2")
    assert dims.shape_of(gathered).as_list() == [8, 64, 32]


def test_a_graph_it_cannot_import_falls_back_to_the_size(monkeypatch):
    graph = _flattening_step()

    def refuse(*args, **kwargs):
        raise ValueError("no")

    monkeypatch.setattr(tf.graph_util, "import_graph_def", refuse)
    dims = shapes.inferred(graph.get_operations(), 8)
    logits = _tensor(graph, "MatMul")
    assert dims.shape_of(logits).as_list() == [None, 1000]
    assert estimated_bytes(logits, dims) == 8 * 1000 * 4


def test_a_known_graph_is_not_imported(monkeypatch):
    monkeypatch.setattr(tf.graph_util, "import_graph_def", None)  # (would fail if called)

    @tf.function(input_signature=[tf.TensorSpec([4, 3])])
    def step(x):
        return tf.reduce_sum(x * 2)

    ops = step.get_concrete_function().graph.get_operations()
    assert int(shapes.inferred(ops, 5)) == 5
