"""The bookkeeping of one simulated step: steps, the buffers alive over them, and the
gradients arriving into them.

A `Timeline` is a list of steps (labels) and a list of buffers, each alive from the
step that makes it to the last step that reads it; its peak is the largest sum of
live bytes over the steps. It is the one buffer store of the memory model: the
simulation of a training step (memsave.planner.simulate) and the replay of a
gradient built apart (memsave.planner.function_run) both keep their buffers in one.
`Gradients` tracks, per tensor, the contributions to its gradient as they arrive and
their sum once the last one has. `forwarded_buffer` is the one rule for a kernel
writing its result into an input's buffer; otherwise this module knows nothing of
TensorFlow's kernels: its callers decide what each step makes and reads.

Each buffer has an owner, what MemoryModel.largest_at_peak names it by: a
`TensorOwner` (a tensor's buffer, or with a gradient kind its gradient's, or with
BESIDE the update of it), an `OpOwner` for what an op's gradient makes or keeps that no
tensor shows (its temporaries, a loop's per-iteration state, a call's intermediates),
or `THE_STEP` for what the training step holds beside them (an optimizer's state).
`Owners` holds one of each tensor's and op's, made once per step.
"""

import collections
import dataclasses

from memsave.planner import intervals

# The end of a buffer alive to the end of the step (resident tensors, the xs' gradients).
FOREVER = 1 << 62
# The kind of the buffers a training step holds beside the gradients (memsave.beside).
BESIDE = "beside"


@dataclasses.dataclass(frozen=True)
class TensorOwner:
    """The owner of a buffer of tensor `tensor` (a StepGraph tensor id): the tensor,
    its gradient (a buffer of a gradient kind), or the update of it (BESIDE)."""
    tensor: int

    def listing_order(self):
        """Where its buffers stand among buffers of the same size (Timeline.alive_at):
        after the step's and the ops', tensors in order."""
        return 2, self.tensor


@dataclasses.dataclass(frozen=True)
class OpOwner:
    """The owner of what op `op`'s gradient makes or keeps that no tensor shows (its
    temporaries, a loop's per-iteration state, a call's intermediates)."""
    op: int

    def listing_order(self):
        """Where its buffers stand among buffers of the same size: after the step's,
        the ops' latest first (the order the listing has always had)."""
        return 1, -self.op


@dataclasses.dataclass(frozen=True)
class StepOwner:
    """The owner of what the training step holds beside its tensors (memsave.beside:
    an optimizer's state, its update's temporaries): no op's and no tensor's."""

    def listing_order(self):
        """Where its buffers stand among buffers of the same size: first."""
        return 0, 0


THE_STEP = StepOwner()


class Owners:
    """The owners of one step's buffers, made once per step and shared by every
    simulation of it: made anew for each buffer, they took a tenth of the time a plan's
    simulation takes (600 plans of a 10-block CNN, 1.5 s against 1.7).

    Attributes:
      of_tensor: per tensor id, its TensorOwner.
      of_op: per op id, its OpOwner.
    """

    def __init__(self, graph):
        """Args:
          graph: the StepGraph.
        """
        self.of_tensor = [TensorOwner(tid) for tid in range(len(graph.tensors))]
        self.of_op = [OpOwner(op) for op in range(len(graph.ops))]


class Timeline:
    """Steps and buffers; the peak is found with one difference-array pass."""

    def __init__(self):
        self.labels = []
        self.starts, self.ends, self.bytes, self.kinds = [], [], [], []
        # Per buffer, whose it is (a TensorOwner, an OpOwner, THE_STEP; None in a
        # replay whose buffers nobody names: memsave.planner.function_run).
        self.owners = []
        # Per buffer, how many allocations of equal size it is made of (a TensorList's
        # elements, a loop's iterations): the allocator replay places each apart.
        self.pieces = []

    def step(self, label):
        """Appends a step labelled `label` (phase, op, segment index); returns its index."""
        self.labels.append(label)
        return len(self.labels) - 1

    def buffer(self, start, nbytes, kind, owner, end=None, pieces=1):
        """Appends a buffer alive from step `start` (to `end`, or only there until a
        later step reads it); returns its index."""
        self.starts.append(start)
        self.ends.append(start if end is None else end)
        self.bytes.append(nbytes)
        self.kinds.append(kind)
        self.owners.append(owner)
        self.pieces.append(pieces)
        return len(self.bytes) - 1

    def copy(self):
        other = Timeline()
        other.labels = list(self.labels)
        other.starts, other.ends = list(self.starts), list(self.ends)
        other.bytes, other.kinds = list(self.bytes), list(self.kinds)
        other.owners, other.pieces = list(self.owners), list(self.pieces)
        return other

    def alive(self, step):
        """Indices of the buffers alive at `step` (of any size), in order."""
        return [buffer for buffer, (start, end) in enumerate(zip(self.starts, self.ends))
                if start <= step <= end]

    def alive_at(self, step):
        """(bytes, kind, owner) of each buffer alive at `step` that holds bytes, largest
        first."""
        alive = [(self.bytes[b], self.kinds[b], self.owners[b]) for b in self.alive(step)
                 if self.bytes[b]]
        return sorted(alive, key=lambda b: (-b[0], b[2].listing_order()))

    def live_at(self, step):
        """Bytes alive at `step`, by kind of buffer."""
        result = {}
        for start, end, nbytes, kind in zip(self.starts, self.ends, self.bytes, self.kinds):
            if start <= step <= end and nbytes:
                result[kind] = result.get(kind, 0) + nbytes
        return result

    def use(self, buffer, step):
        """`buffer` (None: no buffer) is read at `step`: alive at least until then."""
        if buffer is not None and self.ends[buffer] < step:
            self.ends[buffer] = step

    def last_read_at(self, buffer, step):
        """Whether `buffer` is made before `step` and read for the last time there."""
        return (buffer is not None and self.ends[buffer] == step
                and self.starts[buffer] < step)

    def peak(self):
        """(peak bytes, step of the peak)."""
        return intervals.peak(self.starts, self.ends, self.bytes, len(self.labels))


def forwarded_buffer(timeline, candidates, step):
    """The buffer a kernel run at `step` writes its result into instead of allocating
    one: the first of `candidates` that it reads for the last time and that was made
    before it; None where there is none.

    TensorFlow's elementwise kernels (cwise_ops_common.h's UnaryOp and BinaryOp, the
    *Grad kernels of tanh, sigmoid, relu, ...) forward an input's buffer nothing reads
    after them to their output (OpKernelContext::forward_input_or_allocate_output): the
    allocation records show no buffer of the result's own (a chain of tanh; exact
    GELU's gradient, whose products take the recomputed product's and Erfc's buffers in
    a ViT's step; SiLU's gradient, which writes its result into its `1 - sigmoid`).
    The one home of that rule: memsave.planner.simulate asks it of each elementwise
    gradient once every step is simulated (when each buffer's last reader is known),
    memsave.planner.function_run of each op it replays (whose readers it knows ahead).
    Which ops forward, and which inputs fit (the result's size; its shape and type),
    each caller says from what it knows of them.

    Args:
      timeline: the Timeline of the buffers.
      candidates: the buffers of the inputs the kernel may write into, in the order
        it tries them (None: an input with no buffer of its own).
      step: the step the kernel runs at.
    Returns:
      One of `candidates`, or None.
    """
    for buffer in candidates:
        if timeline.last_read_at(buffer, step):
            return buffer
    return None


class Gradients:
    """Gradient buffers: contributions, their sum, and when they are consumed."""

    def __init__(self, graph, timeline, expected, owners, beside=None):
        """Args:
          graph: the StepGraph.
          timeline: the Timeline the buffers go into.
          owners: the step's Owners.
          expected: tensor id -> how many contributions its gradient gets
            (contribution_counts).
          beside: the memsave.beside.Beside of the step, or None.
        """
        self.graph = graph
        self.timeline = timeline
        self.expected = expected
        self.tensor_owners = owners.of_tensor
        self.parts = {}
        self.total = {}
        # An update consuming each x's gradient as it is made (memsave.beside.Beside).
        self.updates_each = beside is not None and beside.updates_each_gradient
        self.update_temporaries = beside.update_temporaries if beside is not None else 0
        # Gradients someone waits for (`watch`), in the order they were completed.
        self.watched = frozenset()
        self.completed = collections.deque()

    def seed(self, tid, step):
        """The gradient of y `tid` (ones) is made at `step`."""
        self._contribute(tid, self.graph.size[tid], step, None)

    def contribute(self, tid, nbytes, step, shares=None):
        """Adds a contribution to the gradient of `tid`; returns the contribution's own
        buffer (None where it shares one), not the sum's that may be made with it."""
        return self._contribute(tid, nbytes, step, shares)

    def _contribute(self, tid, nbytes, step, shares):
        timeline = self.timeline
        kind = "gradients of xs" if self.graph.is_x[tid] else "gradients"
        buffer = (shares if shares is not None
                  else timeline.buffer(step, nbytes, kind, self.tensor_owners[tid],
                                       pieces=self.graph.grad_pieces.get(tid, 1)))
        parts = self.parts.setdefault(tid, [])
        parts.append(buffer)
        if len(parts) >= self.expected.get(tid, 1):
            if len(parts) == 1:
                self.total[tid] = buffer
            else:
                if self.graph.is_x[tid]:
                    # The sum (an AddN) reads every part: an x read twice (a tied
                    # embedding's lookup and vocabulary head) holds its first part
                    # through the backward pass. (So does any tensor's: a residual's skip
                    # gradient lives through its branch's backward pass. Held so for every
                    # tensor, 'memory' planned the default CNN with longer segments, where
                    # the model holds less than the step: 74.9 MiB at 1.35x against 71.6
                    # at 1.29x, AMD EPYC with AVX-512; benchmarks/JOURNAL.md.)
                    for part in parts:
                        timeline.use(part, step)
                self.total[tid] = timeline.buffer(step, nbytes, kind, self.tensor_owners[tid])
            if self.graph.is_x[tid]:
                self._completed_x(tid, nbytes, step)
            if tid in self.watched:
                self.completed.append(tid)
        return None if shares is not None else buffer

    def watch(self, tids):
        """From now on, each of `tids` whose gradient is completed is appended to
        `completed`, for the caller to take."""
        self.watched = frozenset(tids)

    def _completed_x(self, tid, nbytes, step):
        """An x's gradient is a result: alive to the end of the step, or, where a
        training step updates each weight as its gradient is made, read there by the
        update, whose temporaries are alive with it."""
        if not self.updates_each:
            self.timeline.use(self.total[tid], FOREVER)
            return
        temporaries = int(self.update_temporaries * nbytes)
        if temporaries:
            self.timeline.buffer(step, temporaries, BESIDE, self.tensor_owners[tid],
                                 pieces=max(1, round(self.update_temporaries)))

    def complete(self, tids):
        """Whether the gradients of `tids` (a non-empty list) have all arrived."""
        return bool(tids) and all(tid in self.total for tid in tids)

    def consume(self, tid, step):
        """Reads the gradient of `tid` at `step`; returns its buffer (or None)."""
        buffer = self.total.get(tid)
        if buffer is None:
            for part in self.parts.get(tid, ()):  # not all arrived: read what did
                self.timeline.use(part, step)
            return None
        self.timeline.use(buffer, step)
        return buffer


def contribution_counts(graph):
    """Tensor id -> how many contributions its gradient gets: one per op whose gradient
    makes one, and one for each y (its seed)."""
    counts = {}
    for op, pairs in enumerate(graph.grad_inputs):
        for tid, _ in pairs:
            counts[tid] = counts.get(tid, 0) + 1
    for tid, is_y in enumerate(graph.is_y):
        if is_y:
            counts[tid] = counts.get(tid, 0) + 1
    return counts
