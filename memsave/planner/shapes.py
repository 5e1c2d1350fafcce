"""The shapes a step's tensors take once its inputs' unknown dimensions have a size.

A step traced with a batch of None (Keras `fit`, a `[None, 512]` placeholder) leaves
every tensor that follows from the batch with an unknown dimension. Counting each such
dimension as the batch is wrong wherever a dimension is a product or a part of it:
Keras' sparse cross-entropy flattens `[batch, 256, vocab]` logits to
`[batch * 256, vocab]`, an attention reshape splits a width. Here TensorFlow's own shape
inference answers instead: the forward ops are imported into a scratch graph whose
inputs (placeholders, a dataset's next batch, function arguments) have their unknown
dimensions set to the size, and each tensor's shape is read back. Where inference still
leaves a dimension unknown (a nested function's outputs, a value only known when the step
runs) the size itself is assumed, as before.
"""

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)

# Errors TensorFlow raises importing a graph it cannot infer shapes for (a kernel this
# build lacks, a function the library does not hold): the size alone is assumed then.
_IMPORT_ERRORS = (ValueError, TypeError, KeyError, tf.errors.OpError)
_PREFIX = "step"


class UnknownDims(int):
    """The size assumed for unknown dimensions (this int), with the shapes TensorFlow
    infers for a step's tensors once its inputs' unknown dimensions have that size.

    It is the int everywhere a size is asked for (reports, cache keys, arithmetic);
    memsave.region.estimated_bytes asks `shape_of(t)` first.
    """

    def __new__(cls, size, shapes=None):
        dims = super().__new__(cls, size)
        dims._shapes = dict(shapes or {})
        return dims

    def shape_of(self, t):
        """The shape of graph tensor `t` with what inference knows filled in (its own
        static shape where it knows nothing more)."""
        return self._shapes.get((t.op.graph, t.op.name, t.value_index), t.shape)

    def __reduce__(self):
        return (int, (int(self),))


def inferred(ops, size):
    """UnknownDims of `size` for the tensors of `ops` (one graph, any order).

    Args:
      ops: the step's forward ops.
      size: the size of every unknown dimension of the step's inputs (the batch).
    Returns:
      An UnknownDims; it knows no shape where the graph could not be re-inferred.
    """
    if isinstance(size, UnknownDims):
        size = int(size)
    unknown = [t for op in ops for t in op.outputs
               if t.shape.rank is not None and not t.shape.is_fully_defined()]
    if not unknown:
        return UnknownDims(size)
    try:
        shapes = _reinferred(ops, size)
    except _IMPORT_ERRORS as e:  # (the size alone is assumed: a coarser estimate)
        logger.debug("memsave: shapes not re-inferred (%s: %s)", type(e).__name__, e)
        return UnknownDims(size)
    graph = ops[0].graph
    known = {}
    for t in unknown:
        merged = _merged(t.shape, shapes.get((t.op.name, t.value_index)))
        if merged is not None:
            known[(graph, t.op.name, t.value_index)] = merged
    return UnknownDims(size, known)


def _is_input(op):
    """Whether `op` is where the step's data comes in: no data inputs, not a constant
    (whose value shape functions may read)."""
    return op.type != "Const" and all(_not_data(t) for t in op.inputs)


def _not_data(t):
    # (a v1 variable's reference is its variable, not data read from it)
    return t.dtype in (tf.resource, tf.variant, tf.string) or t.dtype != t.dtype.base_dtype


def _filled(shape, size):
    if shape.rank is None:
        return shape
    return tf.TensorShape([size if d is None else d for d in shape.as_list()])


def _reinferred(ops, size):
    """{(op name, output index): TensorShape} from importing `ops` with their inputs'
    unknown dimensions set to `size`."""
    graph = ops[0].graph
    names = {op.name for op in ops}
    full = graph.as_graph_def()
    subset = tf.compat.v1.GraphDef()
    subset.versions.CopyFrom(full.versions)
    subset.library.CopyFrom(full.library)
    for node in full.node:
        if node.name in names:
            subset.node.add().CopyFrom(node)
    for node in subset.node:
        # Control inputs from outside the step order nothing here.
        kept = [i for i in node.input if not i.startswith("^") or i[1:] in names]
        del node.input[:]
        node.input.extend(kept)
    scratch = tf.Graph()
    with scratch.as_default():
        input_map = {}
        for op in ops:
            if not _is_input(op):
                continue
            for t in op.outputs:
                if not _not_data(t):
                    input_map[t.name] = tf.compat.v1.placeholder(
                        t.dtype, _filled(t.shape, size))
        tf.graph_util.import_graph_def(subset, input_map=input_map, name=_PREFIX)
    shapes = {}
    for op in ops:
        try:
            imported = scratch.get_operation_by_name(f"{_PREFIX}/{op.name}")
        except KeyError:
            continue
        for t in imported.outputs:
            shapes[(op.name, t.value_index)] = t.shape
    for name, placeholder in input_map.items():
        op_name, index = name.rsplit(":", 1)
        shapes[(op_name, int(index))] = placeholder.shape
    return shapes


def _merged(static, inferred_shape):
    """`static` with the dimensions it leaves unknown taken from `inferred_shape` (None
    where inference adds nothing)."""
    if inferred_shape is None or inferred_shape.rank is None:
        return None
    if static.rank is None:
        return inferred_shape
    if static.rank != inferred_shape.rank:
        return None
    dims = [s if s is not None else i
            for s, i in zip(static.as_list(), inferred_shape.as_list())]
    if dims == static.as_list():
        return None
    return tf.TensorShape(dims)
