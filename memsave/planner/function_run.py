"""What the ops of a gradient built apart from the step hold as TensorFlow runs them.

A custom gradient's closure (memsave.planner.custom_gradients) and a tf.function
call's backward function (memsave.planner.call_gradients) are each one step of the
memory model, but many ops when they run: this replays those ops in creation order
(what the executor runs; the rest is pruned) and says what is alive at their peak. As
TensorFlow runs them: an identity, or a product with a tensor of ones (which
Grappler's constant folding turns into one), holds no buffer of its own, and an
elementwise op writes into an input it is the last to read (the executor forwards that
buffer to its output), a result too: SiLU's gradient makes its sigmoid and
`1 - sigmoid` and writes its result into one of them, so it adds one tensor to its
result, not two (the 'memory' step of a SiLU MLP measured that, AMD EPYC).
"""

import dataclasses

from memsave.planner import intervals, opinfo
from memsave.region import estimated_bytes


@dataclasses.dataclass(frozen=True)
class Peak:
    """What the ops hold at their peak, besides their results and the given tensors.

    Attributes:
      temporaries: bytes of the tensors they made, in buffers of their own, that are
        alive then (a tensor written into an owned input's buffer, see `run`, is in
        that buffer).
      pieces: about how many tensors hold those bytes (each an allocation of its own,
        placed where it fits): as many as the largest of them fills.
      released: ids of the owned inputs whose buffers are free by then (read for the
        last time before it, and not written into since).
      results_in_inputs: ids of the results written into an owned input's buffer.
      in_inputs: (id of an owned input, bytes) of each owned input's buffer that holds
        one of those tensors instead of its value then (besides `temporaries`).
    """
    temporaries: int
    pieces: int
    released: frozenset = frozenset()
    results_in_inputs: frozenset = frozenset()
    in_inputs: tuple = ()


class _Buffers:
    """Buffers of the ops' tensors: each lives from the op that makes it to the last
    op reading a tensor held in it."""

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


def run(graph, results, given, ones, unknown_dim_size, owned=None):
    """Replays the ops of `graph` that `results` need.

    Args:
      graph: a function graph holding the ops.
      results: the tensors they return, alive after them (the memory model counts
        them as the gradients they are).
      given: ids of the tensors the ops are given (placeholders: incoming gradients,
        captured tensors of the step): no op makes them.
      ones: ids of tensors every element of which is 1.
      unknown_dim_size: the size assumed for unknown dimensions.
      owned: {id(given tensor): bytes} of the given tensors whose buffers the ops may
        free after their last reader and write into (their last readers are these
        ops); the others are held by the step.
    Returns:
      A Peak.
    """
    owned = owned or {}
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

    buffers, inputs, results_in, taken_at = _Buffers(), {}, {}, {}
    for op in ordered:  # (alive from the start: they exist before the ops run)
        for t in op.outputs:
            if id(t) in owned:
                buffers.new(t, 0, owned[id(t)])
                inputs[buffers.of[id(t)]] = id(t)
    for step, op in enumerate(ordered):
        for t in op.inputs:
            buffers.read(t, step)
        for t in op.outputs:
            if id(t) in given:
                buffers.read(t, last_reader(t))
                continue
            source = _shared_input(op, t, ones)
            if source is not None:
                buffers.share(t, source)
            else:
                dying = _forwardable_input(op, t, step, buffers)
                if dying is not None:
                    buffers.share(t, dying)
                    taken_at.setdefault(buffers.of[id(dying)], step)
                else:
                    buffers.new(t, step, estimated_bytes(t, unknown_dim_size))
            if id(t) in result_ids and id(t) in buffers.of:
                results_in[buffers.of[id(t)]] = id(t)
                buffers.read(t, len(ordered))  # (alive after: the gradient it is)
            else:
                buffers.read(t, max(step, last_reader(t)))
    return _peak(buffers, len(ordered), results_in, inputs, taken_at)


def _peak(buffers, steps, results, inputs, taken_at):
    """The Peak of `buffers` over `steps` steps, besides the buffers of `results` and of
    owned inputs (each: buffer -> the tensor's id; `taken_at`: buffer -> the step an
    op first wrote into it). The step counts every result as made at once, so what is
    alive at the peak is less all of them (a result made after the peak too)."""
    if not steps:
        return Peak(0, 1)
    nbytes, at = intervals.peak(buffers.starts, buffers.ends, buffers.sizes, steps)
    alive = {index for index, (start, end) in enumerate(zip(buffers.starts, buffers.ends))
             if start <= at <= end}
    counted = set(results) | (alive & set(inputs))
    temporaries = max(nbytes - sum(buffers.sizes[index] for index in counted), 0)
    largest = max((buffers.sizes[index] for index in alive - counted), default=0)
    return Peak(
        temporaries, max(round(temporaries / largest), 1) if largest else 1,
        released=frozenset(name for index, name in inputs.items() if index not in alive),
        results_in_inputs=frozenset(name for index, name in results.items()
                                    if index in inputs),
        in_inputs=tuple((name, buffers.sizes[index]) for index, name in inputs.items()
                        if index in alive and index not in results
                        and taken_at.get(index, steps) <= at))


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
