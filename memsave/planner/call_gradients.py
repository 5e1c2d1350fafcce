"""What the gradient of a tf.function call keeps of the call's forward run.

A nested `tf.function` runs as one call op (`PartitionedCall`, `StatefulPartitionedCall`).
When tf.gradients takes its gradient, TensorFlow rewrites the call to run a forward
function that also outputs the intermediates its backward function reads (a tanh's
output, a matmul's input), and those outputs live from the call to its gradient. The graph
shows none of them before the rewrite, so they are read off that forward function, which
TensorFlow builds once per call and caches for the gradient it takes later. Measured (AMD
EPYC, 24 calls of `tanh(h @ w) + 0.5 h` on [2048, 256]): tf.gradients' step peaks at 110
MiB, of which 48 MiB are the calls' tanh outputs no tensor of the graph shows.

The gradient is one call of the backward function, one step of the memory model; but
TensorFlow inlines it, and each of its tensors is freed after its last reader inside:
`backward_run` says what it still holds at its own peak.
"""

import dataclasses
import logging

import tensorflow as tf

from memsave.graph import _tf_private, calls
from memsave.planner import function_run, opinfo
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
        graphs = _tf_private.call_gradient_graphs(op)
    except Exception as error:  # (TensorFlow's own tracing of a user's function)
        logger.debug("memsave: cannot build the forward function of %s's gradient (%s: %s); "
                     "counting none of its intermediates", op.name, type(error).__name__, error)
        return 0
    if graphs is None:
        return 0
    forward = graphs[0]
    roles = _roles(op, forward)
    owners = {}
    for t in forward.outputs[len(op.outputs):]:
        owner = _buffer_owner(t)
        if _origin(owner, *roles) == ("held", 0):
            owners[owner.ref()] = owner
    return sum(estimated_bytes(t, unknown_dim_size) for t in owners.values())


def _roles(op, forward):
    """({buffer owner of the forward function's output i: i}, {its argument i: i}) for
    call op `op` (what shares an output's buffer, the tanh a call returns, is held as
    that output)."""
    return ({_buffer_owner(t).ref(): i for i, t in enumerate(forward.outputs[:len(op.outputs)])},
            {t.ref(): i for i, t in enumerate(forward.inputs[:len(op.inputs)])})


def _origin(owner, returned, arguments):
    """What of the step a tensor of the forward function whose buffer is `owner`'s is, as
    BackwardRun names it: ("output", i), ("input", i), ("held", 0), or None for what
    holds no buffer of its own (`returned`, `arguments`: _roles)."""
    if owner.ref() in returned:
        return ("output", returned[owner.ref()])
    if owner.ref() in arguments:
        return ("input", arguments[owner.ref()])
    if owner.op.type in _NO_BUFFER_OF_THEIR_OWN:
        return None
    return ("held", 0)


def _buffer_owner(t):
    """The tensor whose buffer `t` shares (through identities and reshapes)."""
    while t.op.type in opinfo.ALIAS_OP_TYPES and t.op.inputs:
        t = t.op.inputs[0]
    return t


@dataclasses.dataclass(frozen=True)
class BackwardRun:
    """What the backward function of a tf.function call holds at its own peak, run
    inlined as TensorFlow runs it (memsave.planner.function_run).

    The tensors of the step it reads are named ("incoming", i): the gradient of the
    call's output i; ("output", i): the call's output i (an intermediate in its
    buffer); ("held", 0): the intermediates held for it (held_bytes). Where the step
    reads one for the last time in this gradient, the replay frees it after its last
    reader inside and lets an elementwise op write into it.

    Attributes:
      released: those whose buffers are free by then, sorted (every intermediate of
        ("held", 0)).
      temporaries: bytes of the tensors it makes in buffers of their own that are
        alive then, besides the gradients it returns.
      temporary_pieces: about how many tensors hold those bytes.
      written_into: indices of the call's inputs whose gradients it writes into the
        buffer of one of those tensors.
      temporaries_in_reads: (name, bytes) of the tensors it makes in those buffers that
        are alive then: where the step reads that buffer later, they need one of
        their own.
    """
    released: tuple
    temporaries: int
    temporary_pieces: int = 1
    written_into: tuple = ()
    temporaries_in_reads: tuple = ()


def backward_run(op, wanted, unknown_dim_size=1):
    """What the backward function of call op `op` holds at its own peak.

    24 calls of `tanh(h @ w + b)` on [2048, 256] under 'memory' (AMD EPYC with AVX-512):
    the step peaks while a call's backward function makes its input's gradient, by
    when TanhGrad has written into the tanh's buffer and the incoming gradient is
    freed (35.9 MiB measured; 41.5 predicted while the model held both).

    Args:
      op: any op.
      wanted: indices of the inputs whose gradients the step uses (TensorFlow prunes
        the ops of the others once the function is inlined).
      unknown_dim_size: the size assumed for unknown dimensions.
    Returns:
      A BackwardRun, or None for an op that is no tf.function call or whose backward
      function TensorFlow cannot build or lays out otherwise.
    """
    if not calls.is_call(op):
        return None
    try:
        graphs = _tf_private.call_gradient_graphs(op)
    except Exception as error:  # (TensorFlow's own tracing of a user's function)
        logger.debug("memsave: cannot build the backward function of %s (%s: %s); counting "
                     "it as one step", op.name, type(error).__name__, error)
        return None
    if graphs is None:
        return None
    forward, backward = graphs
    origins = _input_origins(op, forward, backward)
    per_input = backward.structured_outputs  # (an input's gradient or None, in order)
    if (origins is None or not isinstance(per_input, (list, tuple))
            or len(per_input) != len(op.inputs)):
        return None
    # (Only what the step reads for the last time here can be freed or written into;
    # a call's input is read again by the gradient of the op that made it.)
    owned = {id(t): estimated_bytes(t, unknown_dim_size)
             for t, origin in zip(backward.inputs, origins)
             if origin is not None and origin[0] != "input"}
    results = [per_input[i] for i in wanted if isinstance(per_input[i], tf.Tensor)]
    peak = function_run.run(backward, results, {id(t) for t in backward.inputs}, set(),
                            unknown_dim_size, owned)
    by_origin = {}
    for t, origin in zip(backward.inputs, origins):
        if id(t) in owned:
            by_origin.setdefault(origin, []).append(id(t))
    in_reads = dict(peak.in_inputs)
    return BackwardRun(
        released=tuple(sorted(origin for origin, ids in by_origin.items()
                              if all(i in peak.released for i in ids))),
        temporaries=peak.temporaries, temporary_pieces=peak.pieces,
        written_into=tuple(i for i in wanted if id(per_input[i]) in peak.results_in_inputs),
        temporaries_in_reads=tuple(sorted(
            (origin, sum(in_reads.get(i, 0) for i in ids)) for origin, ids in by_origin.items()
            if any(i in in_reads for i in ids))))


def _input_origins(op, forward, backward):
    """Per input of the backward function, the tensor of the step whose buffer it reads:
    ("incoming", i), ("output", i), ("input", i) (the call's input i) or ("held", 0) as
    in BackwardRun, or None for what the step holds throughout (a weight, a constant,
    a capture of a tensor of no forward function). Its inputs are the gradients of the
    call's trainable outputs, in order, then its captures; None where they are not."""
    trainable = [i for i, t in enumerate(op.outputs) if _tf_private.is_trainable(t)]
    captured = {id(inner): outer for outer, inner in backward.captures}
    if len(backward.inputs) != len(trainable) + len(captured):
        return None
    roles = _roles(op, forward)
    origins = [("incoming", i) for i in trainable]
    for t in backward.inputs[len(trainable):]:
        outer = captured.get(id(t))
        if outer is None:
            return None
        origins.append(_origin(_buffer_owner(outer), *roles) if outer.graph is forward
                       else None)
    return origins
