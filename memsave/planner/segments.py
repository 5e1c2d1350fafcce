"""Segments of a plan: which recomputed segment copies each region op.

A segment copies everything between its checkpoint (or the ys, for the last
segment) and the checkpoints below it. If a tensor that is not a checkpoint is
read by the ops of two segments, both would copy it and everything above it down
to the next checkpoint; on an unkept residual stream every segment would re-walk
the stream to the start (quadratic recomputation). `Segmentation` therefore also
keeps the tensors read by several segments (found in one reverse pass), so every
region op is copied by exactly one segment.

A segment's gradients read some tensors of the segment as the forward pass made
them, not from its copies (`ForwardReads`): tensors too small to be worth
recomputing (a batch norm's saved statistics), in plans that read their
checkpoints (`read_checkpoints`), the checkpoint the segment ends at, and, in plans
that read their last segment (`read_last_segment`), every tensor of the last segment:
its backward pass starts as the forward pass ends, so recomputing it makes again what
the forward pass has just made (a language model's head and loss: 0.07 of GPT-2's
step), and reading them holds no more, unless forward ops that run after it hold the
peak (a budget's search chooses, or else memsave.plan_variants, by the model). A copy
whose outputs nothing then reads is never run: the segment of a checkpoint made by a
ReLU, whose gradient reads only that output, then recomputes nothing, but the
checkpoint stays alive until that segment's backward pass instead of until the
later segment's recomputation has read it (memsave.plan_variants chooses per plan).

A checkpoint made by a Cast to a wider type (a mixed-precision layer's bfloat16
input cast to float32) is held as the Cast's narrower input, and each segment that
reads it casts that again (`ForwardReads.narrowed`): half the bytes held, for one
elementwise op per reading segment. (Grappler's arithmetic optimizer does the same
for one reader, turning its Identity(Cast(x)) into Cast(Identity(x)), but for one
only: with several, x and the wider checkpoint were both held.)

This is the one place that decides segments: the memory model simulates them
and the builder (memsave.build) builds them.
"""

from memsave.graph.calls import is_call
from memsave.planner.graph import KEPT, REGION, RESIDENT

LAST = -1       # the segment that ends at the ys
_SEVERAL = -2   # read by more than one segment


class ForwardReads:
    """Which tensors a plan's segments' gradients read as the forward pass made them,
    rather than from recomputed copies: a small tensor (StepGraph.small), a tensor of
    the last segment (`last_segment`), or a checkpoint that stays on the device where
    the plan reads its checkpoints. Call it with a tensor id. (Shared by Segmentation,
    which the memory model simulates, and the rewrite, which reroutes those reads.)

    Attributes:
      narrowed: {checkpoint id: id of the narrower input of the Cast that makes it}:
        checkpoints held as that input, which each segment reading them casts again
        (see `narrowed_checkpoints`); they are never read from the forward pass.
      held: ids of the tensors the plan holds for its segments: its checkpoints, the
        narrowed ones' inputs in their place (but inputs alive for the whole step).
      last_segment: ids of the tensors the last segment's ops make
        (Segmentation.last_segment_tensors): never recomputed.
    """

    def __init__(self, graph, checkpoints, offloaded=(), read_checkpoints=False,
                 last_segment=frozenset()):
        self.graph = graph
        self.checkpoints = checkpoints
        self.offloaded = frozenset(offloaded)
        self.read_checkpoints = read_checkpoints
        self.last_segment = frozenset(last_segment)
        self.narrowed = narrowed_checkpoints(graph, checkpoints, self.offloaded)
        self.held = frozenset(set(checkpoints) - set(self.narrowed)) | {
            source for source in self.narrowed.values()
            if graph.kind[graph.producer[source]] != RESIDENT}

    def __call__(self, tid):
        if tid in self.offloaded or tid in self.narrowed:
            return False
        if self.read_checkpoints and tid in self.checkpoints:
            return True
        return tid in self.graph.small or tid in self.last_segment


def widening_cast_input(graph, op):
    """The input id of region op `op` where it is a Cast of a number to a wider type,
    else None. (Not of a bool: under XLA a segment reads its inputs through a
    conditional that passes numbers only, memsave.xla_gates.gated.)"""
    if graph.kind[op] != REGION or graph.ops[op].type != "Cast" or len(graph.inputs[op]) != 1:
        return None
    (source,), (output,) = graph.inputs[op], graph.outputs[op]
    dtype = graph.tensors[source].dtype
    if not (dtype.is_floating or dtype.is_integer or dtype.is_complex):
        return None
    return source if 0 < graph.size[source] < graph.size[output] else None


def narrowed_checkpoints(graph, checkpoints, offloaded=frozenset()):
    """{checkpoint id: input id} of the checkpoints made by a Cast to a wider type
    (`widening_cast_input`), held as that input: not those read by ops that are not
    recomputed (StepGraph.boundaries: those read them from the forward pass), ys, or
    where the checkpoint or the input is offloaded (the offload copies a checkpoint as
    it is; an offloaded input would stay on the device for the segments' Casts)."""
    narrowed = {}
    boundaries = set(graph.boundaries)
    for tid in sorted(checkpoints):
        if graph.is_y[tid] or tid in boundaries or tid in offloaded:
            continue
        source = widening_cast_input(graph, graph.producer[tid])
        if source is not None and source not in offloaded:
            narrowed[tid] = source
    return narrowed


def _merge(a, b):
    if a is None:
        return b
    if b is None or a == b:
        return a
    return _SEVERAL


class Segmentation:
    """The segments of one plan over a StepGraph.

    Attributes:
      checkpoints: tensor ids kept (the plan's, plus `forced` and `shared`).
      forced: tensor ids added because every plan ends segments there
        (StepGraph.boundaries: read by ops that are not recomputed, or ys read by region
        ops).
      shared: tensor ids added because several segments read them.
      segment_of: region op id -> the head op of its segment (LAST for the last).
      order: segment heads in the order the backward pass runs them (LAST first).
      ops: head -> region op ids of that segment, producers first.
      kept_before: segment index -> ids of the ops that are not recomputed (and read
        more than the step's inputs) whose gradients the rewrite takes before that
        segment's: those later in the forward pass than the segment's head
        (memsave.backward orders them so).
      final_ops: op ids whose gradients come after every segment's: the other ops
        that are not recomputed (reads of variables), and region ops no segment holds.
      reads_forward: the plan's ForwardReads: its `read_checkpoints` says whether
        segments' gradients read the checkpoints as the forward pass made them (else
        from their recomputed copies), but for those `offloaded` to host memory.
      reads_last_segment: whether the last segment's gradients read every tensor of
        it as the forward pass made them: where `read_last_segment` asks, but not where
        the last segment holds a function call, whose gradient reads outputs TensorFlow
        adds to the op it is given (the call's copy), which then runs anyway.
    """

    def __init__(self, graph, checkpoints, offloaded=(), read_checkpoints=False,
                 read_last_segment=False):
        self.graph = graph
        self.checkpoints = set(checkpoints)
        self.forced = [t for t in graph.boundaries if t not in self.checkpoints]
        self.checkpoints.update(self.forced)
        self.shared = []
        self.segment_of = {}
        self._assign()
        self.reads_last_segment = bool(read_last_segment) and not any(
            head == LAST and is_call(graph.ops[op]) for op, head in self.segment_of.items())
        self.reads_forward = ForwardReads(
            graph, self.checkpoints, offloaded, read_checkpoints,
            self.last_segment_tensors() if self.reads_last_segment else ())
        self.ops = {}
        loose = []
        for op in graph.region_op_ids():
            head = self.segment_of.get(op)
            if head is None or head == _SEVERAL:
                loose.append(op)
            else:
                self.ops.setdefault(head, []).append(op)
        heads = sorted((h for h in self.ops if h != LAST), reverse=True)
        self.order = ([LAST] if LAST in self.ops else []) + heads
        self.kept_before, self.final_ops = self._kept_ops_in_order(loose)
        self._executed = {}

    def read_by_a_copy(self, tid):
        """Whether a recomputed copy that runs reads tensor `tid`: a copy of one of its
        readers that some gradient needs (`executed`), not in a last segment the plan
        reads from the forward pass (reads_last_segment). Readers no segment holds
        count as reading it. (Whether a gradient reads it is the caller's to ask.)"""
        graph = self.graph
        if tid in self.reads_forward.narrowed.values():
            return True  # (each segment reading its checkpoint casts it again)
        for op in graph.consumers[tid]:
            if graph.kind[op] != REGION:
                continue
            head = self.segment_of.get(op)
            if head is None or head == _SEVERAL:
                return True
            if head == LAST and self.reads_last_segment:
                continue
            if op in self.executed(head):
                return True
        return False

    def last_segment_tensors(self):
        """Ids of the tensors the ops of the last segment (the one ending at the ys) make."""
        return frozenset(t for op, head in self.segment_of.items() if head == LAST
                         for t in self.graph.outputs[op])

    def _assign(self):
        """One reverse pass: each op's segment; tensors several segments read are kept."""
        graph, kept = self.graph, self.checkpoints
        heads = {graph.producer[t] for t in kept}
        for op in reversed(graph.region_op_ids()):
            needs = [(t, self._need(t)) for t in graph.outputs[op] if t not in kept]
            segment = op if op in heads else None
            for _, need in needs:
                segment = _merge(segment, need)
            if segment == _SEVERAL:
                # Every output some segment needs is kept, a y among them too (one output
                # of a split that the last segment ends at, the other read earlier): the op
                # then heads one segment, differentiated once with all its gradients.
                promotable = [t for t, need in needs if need is not None]
                self.shared.extend(promotable)
                kept.update(promotable)
                heads.add(op)
                segment = op
            self.segment_of[op] = segment

    def _need(self, t):
        graph = self.graph
        need = LAST if graph.is_y[t] else None
        for consumer in graph.consumers[t]:
            if graph.kind[consumer] == REGION:
                need = _merge(need, self.segment_of.get(consumer))
        return need

    def _kept_ops_in_order(self, loose):
        """(kept_before, final_ops): where the gradients of the ops that are not
        recomputed come in the backward pass."""
        graph = self.graph
        kept_before, final = {}, list(loose)
        heads = [h for h in self.order if h != LAST]
        for op, kind in enumerate(graph.kind):
            if kind != KEPT:
                continue
            if all(graph.kind[graph.producer[t]] == RESIDENT for t in graph.inputs[op]):
                final.append(op)
                continue
            index = next((i for i, head in enumerate(heads) if head < op), None)
            if index is None:
                final.append(op)
            else:
                kept_before.setdefault(index + (LAST in self.ops), []).append(op)
        return kept_before, sorted(final)

    def executed(self, head):
        """Region op ids of segment `head` whose copies run: those whose outputs some
        gradient of the segment reads from a copy (not `reads_forward`), directly or
        through other copies."""
        result = self._executed.get(head)
        if result is not None:
            return result
        graph, ops = self.graph, self.ops[head]
        members = set(ops)
        needed = {t for op in ops for t in graph.grad_reads[op]
                  if graph.producer[t] in members and not self.reads_forward(t)}
        result = set()
        for op in reversed(ops):
            if any(t in needed for t in graph.outputs[op]):
                result.add(op)
                needed.update(t for t in graph.inputs[op] if graph.producer[t] in members)
        self._executed[head] = result
        return result
