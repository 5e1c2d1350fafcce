"""Copying a set of ops inside their own graph, with input replacements."""

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
        """The copy of an original op or tensor, or None if it was not copied."""
        return self._map(op_or_tensor, self._copy_of)

    def original(self, op_or_tensor):
        """The original of a copied op or tensor, or None if it is not a copy."""
        return self._map(op_or_tensor, self._original_of)

    @staticmethod
    def _map(op_or_tensor, table):
        if hasattr(op_or_tensor, "value_index"):
            op = table.get(op_or_tensor.op)
            return None if op is None else op.outputs[op_or_tensor.value_index]
        return table.get(op_or_tensor)

    def __len__(self):
        return len(self.ops)


def copy_with_input_replacements(ops, replacements=(), name_scope="copy",
                                 copy_control_inputs=True):
    """Copies `ops` into their own graph.

    Inputs produced inside the copied set are read from the copies; inputs listed
    in `replacements` are read from their replacement; every other input is read
    from the original tensor. Copies keep the original's type, attributes
    (colocation included), device and static shape.

    Args:
      ops: the ops to copy (ops, tensors or a list of them), all in one graph.
      replacements: pairs `(original_tensor, replacement_tensor)`, or a TensorMap.
      name_scope: prefix for the copies' names.
      copy_control_inputs: keep the originals' control inputs (mapped to copies
        where the control input is itself copied).
    Returns:
      A `CopyResult`.
    Raises:
      ValueError: if the ops contain a cycle.
    """
    ordered = topological_sort(make_list_of_op(ops))
    replace = replacements if isinstance(replacements, TensorMap) else TensorMap(replacements)
    result = CopyResult()
    for op in ordered:
        inputs = [_resolve_input(t, replace, result) for t in op.inputs]
        new_op = _tf_private.create_op_like(op, inputs, name=f"{name_scope}/{op.name}")
        for old_t, new_t in zip(op.outputs, new_op.outputs):
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
