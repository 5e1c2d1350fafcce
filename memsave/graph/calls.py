"""Function calls: what a `tf.function` call op runs, and whether running it again is safe.

A call op (`PartitionedCall`, `StatefulPartitionedCall`) runs a function of the graph's
library: Keras runs some layers that way (a depthwise convolution compiled with
`jit_compile=True`), and so does any nested `tf.function`. Copying such an op runs the
function again, which gives the same outputs when the function holds no stateful op other
than reads of variables that nothing writes between the call and its copy. TensorFlow
marks every call op as stateful (`StatefulPartitionedCall`) as soon as its function reads
a variable, so this module looks into the function, and into the functions it calls in
turn, to tell.
"""

from tensorflow.python.framework import op_def_registry

from memsave.graph import _tf_private

CALL_OP_TYPES = frozenset(["PartitionedCall", "StatefulPartitionedCall"])

# Stateful ops that give the same result when run again: a variable read (as long as
# nothing writes the variable in between, checked at the call) and an assertion.
_REPEATABLE_STATEFUL_TYPES = frozenset(["ReadVariableOp", "Assert"])

# Op types whose own statefulness is that of the functions they run.
_FUNCTIONAL_TYPES = CALL_OP_TYPES | frozenset(["While", "If", "Case"])

# Ops that read a resource without writing it.
_RESOURCE_READ_TYPES = frozenset(["ReadVariableOp", "VariableShape", "VarIsInitializedOp"])


def is_call(op):
    return op.type in CALL_OP_TYPES


def why_call_not_repeatable(op):
    """Why running call op `op` again could give different outputs, or None if it cannot.

    Args:
      op: a call op (`is_call(op)`).
    Returns:
      None, or a short reason naming the stateful op found or the variable written.
    """
    stateful = stateful_types(op.graph, _called_function_names(op.node_def))
    if stateful is None:
        return "its function is not in the graph's library"
    unsafe = sorted(stateful - _REPEATABLE_STATEFUL_TYPES)
    if unsafe:
        return f"its function runs stateful ops ({', '.join(unsafe[:3])})"
    read_only = set(_read_only_resource_inputs(op))
    initializers = _initializer_ops(op.graph)
    for index, t in enumerate(op.inputs):
        if t.dtype.name != "resource":
            continue
        if index not in read_only:
            return f"it may write the resource {t.name}"
        writer = _resource_writer(t, initializers)
        if writer is not None:
            return f"{writer.name} ({writer.type}) writes the variable it reads"
    return None


def stateful_types(graph, function_names, seen=None):
    """The stateful op types the named functions run, those they call included.

    Args:
      graph: the graph whose library holds the functions.
      function_names: names of functions in that library.
      seen: names already visited (recursion guard).
    Returns:
      A set of op type names, or None where a function is missing from the library.
    """
    seen = set() if seen is None else seen
    found = set()
    for name in function_names:
        if name in seen:
            continue
        seen.add(name)
        definition = _tf_private.function_definition(graph, name)
        if definition is None:
            return None
        for node in definition.node_def:
            nested = _called_function_names(node)
            op_def = op_def_registry.get(node.op)
            if op_def is None:  # a direct call of a library function
                nested = nested + [node.op]
            elif op_def.is_stateful and node.op not in _FUNCTIONAL_TYPES:
                found.add(node.op)
            inner = stateful_types(graph, nested, seen)
            if inner is None:
                return None
            found |= inner
    return found


def names_functions(node_def):
    """Whether a NodeDef runs library functions (a call, a loop, a conditional)."""
    return bool(_called_function_names(node_def))


def _called_function_names(node_def):
    """Names of the functions a NodeDef's attributes name (a call's `f`, a loop's `body`)."""
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(func.name for func in value.list.func)
    return names


def _read_only_resource_inputs(op):
    attrs = op.node_def.attr
    if "_read_only_resource_inputs" not in attrs:
        return []
    return list(attrs["_read_only_resource_inputs"].list.i)


# Ops that pass a resource handle on unchanged: what reads their output reads the handle.
_HANDLE_ALIAS_TYPES = frozenset(["Identity"])


def _resource_writer(handle, initializers):
    """An op of the graph that may write the resource `handle` stands for, or None.

    A variable's initializer (one of `initializers`, a tf.compat.v1 graph's, run once
    before any step) does not count; an identity of the handle (memsave's own segment
    inputs are such) is followed.
    """
    for consumer in handle.consumers():
        if consumer.type in _RESOURCE_READ_TYPES or consumer in initializers:
            continue
        if consumer.type in _HANDLE_ALIAS_TYPES:
            writer = _resource_writer(consumer.outputs[0], initializers)
            if writer is None:
                continue
            return writer
        if names_functions(consumer.node_def):  # (a call, a loop, a conditional)
            indices = [i for i, t in enumerate(consumer.inputs) if t is handle]
            if set(indices) <= set(_read_only_resource_inputs(consumer)):
                continue
        return consumer
    return None


def _initializer_ops(graph):
    """The initializers of the variables a tf.compat.v1 graph collects."""
    variables = (graph.get_collection("variables") + graph.get_collection("local_variables"))
    return {v.initializer for v in variables if getattr(v, "initializer", None) is not None}
