"""Copying a set of ops, inside their own graph or into another one, with input replacements."""

from memsave.graph import _tf_private
from memsave.graph.select import TensorMap, make_list_of_op, topological_sort


class CopyResult:
    """What `copy_with_input_replacements` made: originals mapped to copies and back.

    Attributes:
      ops: the new ops, in the order they were created (topological).
    """

    def __init__(self):
        self._copy_of = {}
        self._original_of = {}
        self.ops = []

    def _record(self, original_op, new_op):
        self._copy_of[original_op] = new_op
        self._original_of[new_op] = original_op
        self.ops.append(new_op)

    def transformed(self, op_or_tensor):
        """The copy of an original op or tensor.

        Args:
          op_or_tensor: an original op, or one of its output tensors.
        Returns:
          The copied op (or the copy's output with the same index), or None if
          it was not copied.
        """
        return self._map(op_or_tensor, self._copy_of)

    def original(self, op_or_tensor):
        """The original of a copied op or tensor.

        Args:
          op_or_tensor: a copied op, or one of its output tensors.
        Returns:
          The original op (or its output with the same index), or None if it is
          not a copy made by this call.
        """
        return self._map(op_or_tensor, self._original_of)

    @staticmethod
    def _map(op_or_tensor, table):
        if hasattr(op_or_tensor, "value_index"):
            op = table.get(op_or_tensor.op)
            index = op_or_tensor.value_index
            # (A copy of a call tf.gradients rewrote has its inference outputs only.)
            return None if op is None or index >= len(op.outputs) else op.outputs[index]
        return table.get(op_or_tensor)

    def __len__(self):
        return len(self.ops)


def copy_with_input_replacements(ops, replacements=(), name_scope="copy",
                                 copy_control_inputs=True):
    """Copies `ops` into their own graph.

    Each input of a copy is, in this order of precedence: the copy of the tensor
    if its producer is in the copied set; its replacement if `replacements` names
    it (so replacements act on the inputs coming from outside the set, as in the
    old graph editor); otherwise the original tensor. Copies keep the original's
    type, attributes (colocation and `_gradient_op_type` included), device and
    static shape. Like any new op, they also get the control dependencies of an
    enclosing `tf.control_dependencies` block.

    Args:
      ops: the ops to copy (ops, tensors standing for their producers, or a
        list of them), all in one graph.
      replacements: pairs `(original_tensor, replacement_tensor)`, or a TensorMap.
      name_scope: prefix for the copies' names (made unique by the graph).
      copy_control_inputs: keep the originals' control inputs (mapped to copies
        where the control input is itself copied).
    Returns:
      A `CopyResult`.
    Raises:
      ValueError: if the ops contain a cycle, span several graphs, or a
        replacement's graph, dtype or shape does not fit the tensor it replaces.
        Nothing is created then.
    """
    ordered = topological_sort(make_list_of_op(ops))
    replace = replacements if isinstance(replacements, TensorMap) else TensorMap(replacements)
    _check_copy_inputs(ordered, replace)
    result = CopyResult()
    for op in ordered:
        inputs = [_resolve_input(t, replace, result) for t in op.inputs]
        new_op = _tf_private.create_op_like(op, inputs, name=f"{name_scope}/{op.name}")
        for old_t, new_t in zip(op.outputs, new_op.outputs):
            # (A function call's outputs get their shapes from the function, not from
            # shape inference over its NodeDef.)
            new_t.set_shape(old_t.shape)
        if copy_control_inputs and op.control_inputs:
            controls = [result.transformed(c) or c for c in op.control_inputs]
            _tf_private.add_control_inputs(new_op, controls)
        result._record(op, new_op)
    return result


def _resolve_input(t, replace, result):
    copied = result.transformed(t)
    if copied is not None:
        return copied
    return replace.get(t, t)


def _check_copy_inputs(ops, replace):
    graphs = list(dict.fromkeys(op.graph for op in ops))
    if len(graphs) > 1:
        raise ValueError("memsave.graph: cannot copy ops from several graphs at once")
    for original, replacement in replace.items():
        if graphs and replacement.graph is not graphs[0]:
            raise ValueError(f"memsave.graph: replacement {replacement.name} for {original.name} "
                             "is in another graph than the ops to copy")
        if replacement.dtype.base_dtype != original.dtype.base_dtype:
            raise ValueError(f"memsave.graph: cannot replace {original.name} "
                             f"({original.dtype.name}) by {replacement.name} "
                             f"({replacement.dtype.name}): dtypes differ")
        if not replacement.shape.is_compatible_with(original.shape):
            raise ValueError(f"memsave.graph: cannot replace {original.name} {original.shape} "
                             f"by {replacement.name} {replacement.shape}: shapes are incompatible")


def copy_into_graph(ops, graph, mapping, name_scope=None, copy_control_inputs=False,
                    result=None):
    """Copies `ops`, in the order given (producers first), into `graph`: a loop body
    being rebuilt, or the gradient graph of one.

    Every input of a copy is the copy of its producer, or what `mapping` maps it to;
    `mapping` gains each copied tensor. Copies keep the original's type, attributes
    and static shape.

    Args:
      ops: the ops to copy, producers first.
      graph: the graph to create the copies in.
      mapping: a TensorMap from tensors the ops read to tensors of `graph`; updated.
      name_scope: a prefix for the copies' names; None keeps the originals' names
        (made unique by `graph`).
      copy_control_inputs: keep the originals' control inputs, each of which must have
        been copied before (by this call or into `result`); otherwise the copies have none.
      result: a `CopyResult` of earlier copies into `graph` to add these to.
    Returns:
      The `CopyResult`.
    Raises:
      ValueError: if an op reads a tensor that is neither copied before it nor mapped,
        or waits for an op not copied before it. Ops copied before the error stay in
        `graph` (a graph under construction).
    """
    result = CopyResult() if result is None else result
    for op in ops:
        missing = [t.name for t in op.inputs if t not in mapping]
        if missing:
            raise ValueError(f"memsave.graph: cannot copy {op.name} into {graph.name}: "
                             f"it reads {missing[0]}, which is neither copied nor mapped")
        name = op.name if name_scope is None else f"{name_scope}/{op.name}"
        new_op = _tf_private.create_op_like(op, [mapping[t] for t in op.inputs], name,
                                            graph=graph)
        for old_t, new_t in zip(op.outputs, new_op.outputs):
            new_t.set_shape(old_t.shape)
            mapping[old_t] = new_t
        if copy_control_inputs:
            controls = [result.transformed(c) for c in op.control_inputs]
            if None in controls:
                raise ValueError(f"memsave.graph: cannot copy {op.name} into {graph.name}: it "
                                 "waits for an op that is not copied before it")
            _tf_private.add_control_inputs(new_op, controls)
        result._record(op, new_op)
    return result
