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

import numpy as np
import tensorflow as tf

from memsave.graph import _tf_private
from memsave.planner import function_run

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GradientProbe:
    """What one op's custom gradient does.

    Attributes:
      reads: the tensors of the step's graph it reads.
      differentiated: indices of the op's inputs it returns a gradient for.
      temporaries: the most bytes its own intermediate tensors hold at once while it
        makes those gradients (its results not counted).
      temporary_pieces: about how many tensors hold those bytes at that moment (each an
        allocation of its own, placed where it fits): as many as the largest fills.
    """
    reads: tuple
    differentiated: tuple
    temporaries: int
    temporary_pieces: int = 1


def has_custom_gradient(op):
    """Whether `op`'s gradient is not its type's registered one."""
    return _tf_private.overridden_gradient_type(op) is not None


def probe(op, wanted, unknown_dim_size=1):
    """Builds `op`'s gradient once in a scratch graph and says what it does.

    Args:
      op: an op with a custom gradient (has_custom_gradient).
      wanted: indices of the inputs whose gradients the step uses (the others, such as
        swish's constant beta's, are built but never run): the temporaries are those
        of these.
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
    results = [_tensor_of(grads[i]) for i in differentiated if i in wanted]
    placeholders = {id(inner) for _, inner in scratch.captures} | {id(t) for t in incoming}
    ones = {id(inner) for outer, inner in scratch.captures if _all_ones(outer)} | {
        id(t) for o in scratch.get_operations() if o.type == "Const" for t in o.outputs
        if _all_ones(t)}
    peak = function_run.run(scratch, [r for r in results if r is not None], placeholders,
                            ones, unknown_dim_size)
    return GradientProbe(
        # (a captured eager tensor, such as a variable's handle, is no tensor of the step)
        reads=tuple(outer for outer, _ in scratch.captures if isinstance(outer, tf.Tensor)
                    and not _tf_private.is_eager_tensor(outer)),
        differentiated=differentiated, temporaries=peak.temporaries,
        temporary_pieces=peak.pieces)


def _all_ones(t):
    """Whether `t` is a constant whose every element is 1 (swish's default beta)."""
    if not isinstance(t, tf.Tensor) or _tf_private.is_eager_tensor(t):
        return False
    value = tf.get_static_value(t)
    return value is not None and np.size(value) > 0 and bool(np.all(value == 1))


def _tensor_of(gradient):
    """The dense tensor of a gradient (an IndexedSlices' values), or None."""
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return gradient if isinstance(gradient, tf.Tensor) else None
