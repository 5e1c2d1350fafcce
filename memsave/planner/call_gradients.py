"""What the gradient of a tf.function call keeps of the call's forward run.

A nested `tf.function` runs as one call op (`PartitionedCall`, `StatefulPartitionedCall`).
When tf.gradients takes its gradient, TensorFlow rewrites the call to run a forward
function that also outputs the intermediates its backward function reads (a tanh's
output, a matmul's input), and those outputs live from the call to its gradient. The graph
shows none of them before the rewrite, so they are read off that forward function, which
TensorFlow builds once per call and caches for the gradient it takes later. Measured (AMD
EPYC, 24 calls of `tanh(h @ w) + 0.5 h` on [2048, 256]): tf.gradients' step peaks at 110
MiB, of which 48 MiB are the calls' tanh outputs no tensor of the graph shows.
"""

import logging

from memsave.graph import _tf_private, calls
from memsave.planner import opinfo
from memsave.region import estimated_bytes

logger = logging.getLogger(__name__)

# Outputs of a forward function that hold no buffer of their own: an argument passed
# on (the call's input, held by the step anyway), a constant, a variable's value.
_NO_BUFFER_OF_THEIR_OWN = frozenset(["Placeholder", "Const", "ReadVariableOp"])


def held_bytes(op, unknown_dim_size=1):
    """Bytes of the intermediates tf.gradients has call op `op` output for its backward
    function, beyond its own outputs and what holds no buffer of its own.

    Args:
      op: any op.
      unknown_dim_size: the size assumed for their unknown dimensions.
    Returns:
      0 for an op that is no tf.function call, a call whose gradient was taken already
      (its outputs show them), or where TensorFlow cannot build the forward function.
    """
    if not calls.is_call(op):
        return 0
    try:
        outputs = _tf_private.call_gradient_intermediates(op)
    except Exception as error:  # (TensorFlow's own tracing of a user's function)
        logger.debug("memsave: cannot build the forward function of %s's gradient (%s: %s); "
                     "counting none of its intermediates", op.name, type(error).__name__, error)
        return 0
    if outputs is None:
        return 0
    own, intermediates = outputs
    # (What shares an output's buffer, the tanh a call returns, is held as that output.)
    returned = {_buffer_owner(t).ref() for t in own}
    owners = {}
    for t in intermediates:
        owner = _buffer_owner(t)
        if owner.op.type not in _NO_BUFFER_OF_THEIR_OWN and owner.ref() not in returned:
            owners[owner.ref()] = owner
    return sum(estimated_bytes(t, unknown_dim_size) for t in owners.values())


def _buffer_owner(t):
    """The tensor whose buffer `t` shares (through identities and reshapes)."""
    while t.op.type in opinfo.ALIAS_OP_TYPES and t.op.inputs:
        t = t.op.inputs[0]
    return t
