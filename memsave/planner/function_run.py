"""What the ops of a gradient built apart from the step hold as TensorFlow runs them.

A custom gradient's closure (memsave.planner.custom_gradients) and a tf.function
call's backward function (memsave.planner.call_gradients) are each one step of the
memory model, but many ops when they run: this replays those ops in creation order
(what the executor runs; the rest is pruned) on a Timeline of their own, one step per
op, and says what is alive at their peak. As TensorFlow runs them: an identity, or a
product with a tensor of ones (which Grappler's constant folding turns into one), holds
no buffer of its own, and an elementwise op writes into an input it is the last to read
(memsave.planner.timeline.forwarded_buffer, the rule the step's simulation follows
too), a result too: SiLU's gradient makes its sigmoid and `1 - sigmoid` and writes its
result into one of them, so it adds one tensor to its result, not two (the 'memory'
step of a SiLU MLP measured that, AMD EPYC).
"""

import dataclasses

from memsave.planner import opinfo
from memsave.planner.timeline import Timeline, forwarded_buffer
from memsave.region import estimated_bytes

# The kinds of the replay's buffers: the given tensors it owns, and what its ops make.
_GIVEN, _MADE = "given", "made"


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


class _Replay:
    """The replay in progress: its Timeline, and which buffer holds each tensor."""

    def __init__(self, ordered, result_ids):
        self.ordered = ordered
        self.position = {op: i for i, op in enumerate(ordered)}
        self.result_ids = result_ids
        self.timeline = Timeline()
        self.of = {}  # id(tensor) -> its buffer in the timeline
        self.inputs = {}  # buffer -> id of the owned input it was made for
        self.results = {}  # buffer -> id of the result it holds
        self.taken_at = {}  # buffer of an owned input -> the step an op first wrote into it

    def read(self, t, step):
        """Tensor `t` (its buffer, where it has one) is read at `step`."""
        self.timeline.use(self.of.get(id(t)), step)

    def last_reader(self, t):
        """The step of the last op replayed that reads `t` (-1: none)."""
        return max((self.position[c] for c in t.consumers() if c in self.position),
                   default=-1)

    def own(self, owned):
        """Buffers for the owned given tensors, alive from the start (they exist before
        the ops run)."""
        for op in self.ordered:
            for t in op.outputs:
                if id(t) in owned:
                    self.of[id(t)] = self.timeline.buffer(0, owned[id(t)], _GIVEN, None)
                    self.inputs[self.of[id(t)]] = id(t)

    def output(self, op, t, step, ones, unknown_dim_size):
        """Output `t` of `op`, run at `step`: in an input's buffer, or a new one; alive
        to its last reader (a result to after the last op: the gradient it is)."""
        source = _shared_input(op, t, ones)
        if source is not None:
            if id(source) in self.of:
                self.of[id(t)] = self.of[id(source)]
        else:
            taken = forwarded_buffer(self.timeline, self._fitting_inputs(op, t), step)
            if taken is not None:
                self.of[id(t)] = taken
                self.taken_at.setdefault(taken, step)
            else:
                self.of[id(t)] = self.timeline.buffer(
                    step, estimated_bytes(t, unknown_dim_size), _MADE, None)
        if id(t) in self.result_ids and id(t) in self.of:
            self.results[self.of[id(t)]] = id(t)
            self.read(t, len(self.ordered))
        else:
            self.read(t, max(step, self.last_reader(t)))

    def _fitting_inputs(self, op, t):
        """The buffers of `op`'s inputs that an elementwise kernel may write output `t`
        into (timeline.forwarded_buffer decides which it does): those of `t`'s shape and
        type with a buffer of their own; none for a heavy op or a shape not known."""
        if op.type in opinfo.HEAVY_OP_TYPES or not t.shape.is_fully_defined():
            return []
        return [self.of[id(x)] for x in op.inputs
                if id(x) in self.of and x.dtype == t.dtype and x.shape == t.shape]


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
    replay = _Replay(_needed_in_order(graph, results), {id(r) for r in results})
    replay.own(owned or {})
    for op in replay.ordered:
        step = replay.timeline.step(op)
        for t in op.inputs:
            replay.read(t, step)
        for t in op.outputs:
            if id(t) in given:
                replay.read(t, replay.last_reader(t))
            else:
                replay.output(op, t, step, ones, unknown_dim_size)
    return _peak(replay)


def _needed_in_order(graph, results):
    """The ops of `graph` that `results` need (through inputs and control inputs), in
    creation order."""
    needed, stack = set(), [r.op for r in results]
    while stack:
        op = stack.pop()
        if op not in needed:
            needed.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return [op for op in graph.get_operations() if op in needed]


def _peak(replay):
    """The Peak of the replay, besides the buffers of its results and of owned inputs.
    The step counts every result as made at once, so what is alive at the peak is less
    all of them (a result made after the peak too)."""
    timeline, inputs, steps = replay.timeline, replay.inputs, len(replay.ordered)
    if not steps:
        return Peak(0, 1)
    nbytes, at = timeline.peak()
    alive = set(timeline.alive(at))
    counted = set(replay.results) | (alive & set(inputs))
    temporaries = max(nbytes - sum(timeline.bytes[index] for index in counted), 0)
    largest = max((timeline.bytes[index] for index in alive - counted), default=0)
    return Peak(
        temporaries, max(round(temporaries / largest), 1) if largest else 1,
        released=frozenset(name for index, name in inputs.items() if index not in alive),
        results_in_inputs=frozenset(name for index, name in replay.results.items()
                                    if index in inputs),
        in_inputs=tuple((name, timeline.bytes[index]) for index, name in inputs.items()
                        if index in alive and index not in replay.results
                        and replay.taken_at.get(index, steps) <= at))


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
