"""What an op's custom gradient reads, found by building it once where nobody runs it.

A `tf.custom_gradient` (Keras' and TensorFlow's swish/SiLU, `tf.recompute_grad`, a
user's own) is an IdentityN whose gradient is a Python closure: it reads the tensors it
closed over, not the op's inputs and outputs, and sends no gradient to the ops that
computed the forward result (e.g. swish's gradient reads its input and recomputes the
sigmoid; the forward pass's sigmoid and product are never read again). No table by op
type can say that, so the gradient function is called once in a scratch function graph
inside the step's graph: the tensors of the step it captures are what it reads, the
gradients it returns as None go nowhere, and the ops it builds on the way to the others
are its temporaries. Nothing is added to the step's graph.
"""

import dataclasses
import logging

import tensorflow as tf

from memsave.graph import _tf_private
from memsave.region import estimated_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GradientProbe:
    """What one op's custom gradient does.

    Attributes:
      reads: the tensors of the step's graph it reads.
      differentiated: indices of the op's inputs it returns a gradient for.
      temporaries: the most bytes its own intermediate tensors hold at once while it
        makes those gradients (its results not counted).
    """
    reads: tuple
    differentiated: tuple
    temporaries: int


def has_custom_gradient(op):
    """Whether `op`'s gradient is not its type's registered one."""
    return _tf_private.overridden_gradient_type(op) is not None


def probe(op, unknown_dim_size=1):
    """Builds `op`'s gradient once in a scratch graph and says what it does.

    Args:
      op: an op with a custom gradient (has_custom_gradient).
      unknown_dim_size: the size assumed for unknown dimensions of its temporaries.
    Returns:
      A GradientProbe, or None where the gradient function cannot be built there (the
      caller then assumes it reads every input and output).
    """
    function = _tf_private.gradient_function(op)
    if function is None or not op.outputs:
        return None
    scratch = _tf_private.scratch_graph(op.graph, f"memsave_probe_{op.name}")
    try:
        with scratch.as_default():
            incoming = [tf.compat.v1.placeholder(t.dtype, t.shape) for t in op.outputs]
            grads = function(op, *incoming)
    except Exception as error:  # a user's function: anything may go wrong out of place
        logger.debug("memsave: cannot build the gradient of %s to see what it reads (%s: %s); "
                     "assuming it reads every input and output", op.name,
                     type(error).__name__, error)
        return None
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    differentiated = tuple(i for i, g in enumerate(grads[:len(op.inputs)]) if g is not None)
    results = [_tensor_of(grads[i]) for i in differentiated]
    placeholders = {id(inner) for _, inner in scratch.captures} | {id(t) for t in incoming}
    return GradientProbe(
        # (a captured eager tensor, such as a variable's handle, is no tensor of the step)
        reads=tuple(outer for outer, _ in scratch.captures if isinstance(outer, tf.Tensor)
                    and not _tf_private.is_eager_tensor(outer)),
        differentiated=differentiated,
        temporaries=_temporaries(scratch, [r for r in results if r is not None], placeholders,
                                 unknown_dim_size))


def _tensor_of(gradient):
    """The dense tensor of a gradient (an IndexedSlices' values), or None."""
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return gradient if isinstance(gradient, tf.Tensor) else None


def _temporaries(graph, results, placeholders, unknown_dim_size):
    """The most bytes alive at once among the tensors `graph`'s ops make on the way to
    `results` (what the executor runs; the rest is pruned), in creation order, each
    from its op to its last reader; the results and the placeholders not counted."""
    needed, stack = set(), [r.op for r in results]
    while stack:
        op = stack.pop()
        if op in needed:
            continue
        needed.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    ordered = [op for op in graph.get_operations() if op in needed]
    position = {op: i for i, op in enumerate(ordered)}
    result_ids = {id(r) for r in results}
    live = [0] * (len(ordered) + 1)
    for start, op in enumerate(ordered):
        for t in op.outputs:
            if id(t) in placeholders or id(t) in result_ids:
                continue
            readers = [position[c] for c in t.consumers() if c in position]
            end = max(readers, default=start)
            nbytes = estimated_bytes(t, unknown_dim_size)
            live[start] += nbytes
            live[end + 1] -= nbytes
    peak = current = 0
    for change in live:
        current += change
        peak = max(peak, current)
    return peak
