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
# Ops of a function's body whose outputs are no buffer it makes: those, and views.
_MAKES_NO_BUFFER = _NO_BUFFER_OF_THEIR_OWN | opinfo.ALIAS_OP_TYPES


def run_bytes(op, unknown_dim_size=1):
    """What call op `op`'s run holds that no tensor of the graph shows.

    Args:
      op: any op.
      unknown_dim_size: the size assumed for unknown dimensions.
    Returns:
      (held, transient): the bytes of the intermediates tf.gradients has the call output
      for its backward function, beyond its own outputs and what holds no buffer of its
      own; and of the largest buffer its run makes and frees before it returns (a
      matmul's output its tanh reads). (0, 0) for an op that is no tf.function call, a
      call whose gradient was taken already (its outputs show them), or where
      TensorFlow cannot build the forward function.

    The transient buffer is allocated before the call's outputs and decides where the
    allocator places them: without it, a replay of BFC put each of 24 nested calls'
    [2048, 256] outputs in a 4 MiB chunk two freed neighbours had made ('memory':
    replayed 41.5 MiB, measured 34.7-41.0 with 2 MiB chunks in the allocation records;
    AMD EPYC with AVX-512).
    """
    buffers = _forward_run_buffers(op)
    if buffers is None:
        return 0, 0
    kept, freed = buffers
    return (sum(estimated_bytes(t, unknown_dim_size) for t in kept),
            max((estimated_bytes(t, unknown_dim_size) for t in freed), default=0))


def _forward_run_buffers(op):
    """([buffers kept for the backward function beyond the outputs], [buffers freed
    within the run]) of the forward function of call op `op`'s gradient, as tensors of
    that function, each by the tensor owning it; None where there is none."""
    if not calls.is_call(op):
        return None
    try:
        outputs = _tf_private.call_gradient_intermediates(op)
    except Exception as error:  # (TensorFlow's own tracing of a user's function)
        logger.debug("memsave: cannot build the forward function of %s's gradient (%s: %s); "
                     "counting none of its intermediates", op.name, type(error).__name__, error)
        return None
    if outputs is None:
        return None
    own, intermediates = outputs
    # (What shares an output's buffer, the tanh a call returns, is held as that output.)
    returned = {_buffer_owner(t).ref() for t in own}
    kept = {}
    for t in intermediates:
        owner = _buffer_owner(t)
        if owner.op.type not in _NO_BUFFER_OF_THEIR_OWN and owner.ref() not in returned:
            kept[owner.ref()] = owner
    function_graph = own[0].graph if own else None
    freed = [] if function_graph is None else [
        t for body_op in function_graph.get_operations()
        if body_op.type not in _MAKES_NO_BUFFER
        for t in body_op.outputs
        if t.ref() not in returned and t.ref() not in kept]
    return list(kept.values()), freed


def _buffer_owner(t):
    """The tensor whose buffer `t` shares (through identities and reshapes)."""
    while t.op.type in opinfo.ALIAS_OP_TYPES and t.op.inputs:
        t = t.op.inputs[0]
    return t
