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
from memsave.planner import intervals, opinfo
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
    temporaries, pieces = _temporaries(scratch, [r for r in results if r is not None],
                                       placeholders, ones, unknown_dim_size)
    return GradientProbe(
        # (a captured eager tensor, such as a variable's handle, is no tensor of the step)
        reads=tuple(outer for outer, _ in scratch.captures if isinstance(outer, tf.Tensor)
                    and not _tf_private.is_eager_tensor(outer)),
        differentiated=differentiated, temporaries=temporaries, temporary_pieces=pieces)


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


class _Buffers:
    """Buffers of a probed gradient's tensors: each lives from the op that makes it to
    the last op reading a tensor held in it."""

    def __init__(self):
        self.of = {}  # id(tensor) -> buffer index
        self.starts, self.ends, self.sizes = [], [], []

    def new(self, t, step, nbytes):
        self.of[id(t)] = len(self.sizes)
        self.starts.append(step)
        self.ends.append(step)
        self.sizes.append(nbytes)

    def share(self, t, source):
        if id(source) in self.of:
            self.of[id(t)] = self.of[id(source)]

    def read(self, t, step):
        index = self.of.get(id(t))
        if index is not None:
            self.ends[index] = max(self.ends[index], step)

    def peak_besides(self, steps, results):
        """(the most bytes alive at once less the bytes of buffers `results`, about how
        many of the other buffers alive then hold them: as many as the largest fills)."""
        nbytes, at = intervals.peak(self.starts, self.ends, self.sizes, steps)
        nbytes = max(nbytes - sum(self.sizes[index] for index in results), 0)
        largest = max((size for index, (start, end, size)
                       in enumerate(zip(self.starts, self.ends, self.sizes))
                       if start <= at <= end and index not in results), default=0)
        return nbytes, max(round(nbytes / largest), 1) if largest else 1


def _temporaries(graph, results, placeholders, ones, unknown_dim_size):
    """(bytes, about how many tensors hold them): the most bytes the tensors `graph`'s ops
    make on the way to `results` (what the executor runs; the rest is pruned; run in
    creation order) hold at once beyond the results, which the model counts as the
    gradients they are; the placeholders (incoming gradients, captured forward tensors)
    not counted. As TensorFlow runs them: an identity, or a product with a tensor of
    ones (which Grappler's constant folding turns into one), holds no buffer of its
    own, and an elementwise op writes into an input it is the last to read (the
    executor forwards that buffer to its output), a result too: SiLU's gradient makes
    its sigmoid and `1 - sigmoid` and writes its result into one of them, so it adds one
    tensor to its result, not two (the 'memory' step of a SiLU MLP measured that, AMD
    EPYC)."""
    needed, stack = set(), [r.op for r in results]
    while stack:
        op = stack.pop()
        if op not in needed:
            needed.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    ordered = [op for op in graph.get_operations() if op in needed]
    position = {op: i for i, op in enumerate(ordered)}
    result_ids = {id(r) for r in results}

    def last_reader(t):
        return max((position[c] for c in t.consumers() if c in position), default=-1)

    buffers, result_buffers = _Buffers(), set()
    for step, op in enumerate(ordered):
        for t in op.inputs:
            buffers.read(t, step)
        for t in op.outputs:
            if id(t) in placeholders:
                continue
            source = _shared_input(op, t, ones)
            if source is not None:
                buffers.share(t, source)
            else:
                dying = _forwardable_input(op, t, step, buffers)
                if dying is not None:
                    buffers.share(t, dying)
                else:
                    buffers.new(t, step, estimated_bytes(t, unknown_dim_size))
            if id(t) in result_ids and id(t) in buffers.of:
                result_buffers.add(buffers.of[id(t)])
                buffers.read(t, len(ordered))  # (alive after: the gradient it is)
            else:
                buffers.read(t, max(step, last_reader(t)))
    return buffers.peak_besides(len(ordered), result_buffers)


def _shared_input(op, t, ones):
    """The input whose buffer output `t` of `op` is: an identity's, or the other factor of
    a product with a tensor of ones of no larger shape (Grappler folds it away)."""
    if op.type in opinfo.ALIAS_OP_TYPES and op.inputs:
        return op.inputs[0]
    if op.type == "Mul" and len(op.inputs) == 2:
        a, b = op.inputs
        for factor, other in ((a, b), (b, a)):
            if id(factor) in ones and other.shape == t.shape:
                return other
    return None


def _forwardable_input(op, t, step, buffers):
    """An input of an elementwise `op` (run at `step`) that holds a buffer of its own,
    has `t`'s shape and type, and whose buffer nothing reads after `op`: that buffer
    becomes `t`'s."""
    if op.type in opinfo.HEAVY_OP_TYPES or not t.shape.is_fully_defined():
        return None
    for x in op.inputs:
        index = buffers.of.get(id(x))
        if (index is not None and x.dtype == t.dtype and x.shape == t.shape
                and buffers.ends[index] <= step):
            return x
    return None
