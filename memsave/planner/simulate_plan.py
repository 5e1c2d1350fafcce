"""What a plan's simulated backward pass adds to tf.gradients': segments.

Each segment (last first) runs its recomputation, then its gradient steps over its
recomputed buffers (an `Overlay` of them over the forward pass's); where the plan
recomputes ahead, a segment's recomputation runs as soon as the gradient it waits for
is complete, which may be within an earlier segment's backward pass; offloaded
checkpoints come back before the segments that read them; the weight gradients the
rewrite makes last run after every segment. The gradient steps themselves are
memsave.planner.simulate's (`run.gradient_step`); this module decides when they run
and which buffers they read.
"""

import dataclasses

from memsave.planner import schedule


@dataclasses.dataclass
class Recomputed:
    """A segment's recomputed buffers: per tensor id, and per op what its gradient
    keeps of the copy's run (StepGraph.held) and the copy's folded product
    (StepGraph.folded)."""
    tensors: dict = dataclasses.field(default_factory=dict)
    held: dict = dataclasses.field(default_factory=dict)
    folded: dict = dataclasses.field(default_factory=dict)


class Overlay:
    """Recomputed buffers of a segment over the forward ones; tensors that
    `reads_forward(tid)` says the gradients read from the forward pass come from there."""

    def __init__(self, recomputed, forward, reads_forward):
        self.recomputed = recomputed
        self.forward = forward
        self.reads_forward = reads_forward

    def __getitem__(self, tid):
        if self.reads_forward(tid):
            return self.forward[tid]
        buffer = self.recomputed.tensors.get(tid)
        return self.forward[tid] if buffer is None else buffer


def run_segments(run, offloaded=frozenset(), prefetch=1, ahead=False):
    """Each segment of `run` (memsave.planner.simulate's run of a plan): its
    recomputation, then its backward; then the deferred weight gradients, then the
    gradients of the ops no segment recomputes.

    Args:
      run: the simulation in progress (its graph, timeline, gradients, forward buffers
        and gradient_step).
      offloaded: checkpoints in host memory: one a segment reads comes back into a
        buffer of its own from the start of the segment `prefetch` segments earlier
        (memsave.offload).
      ahead: each segment's recomputation runs as soon as the gradient it waits for
        (the one the segment after it in the forward pass waits for) is complete, which
        may be in the middle of an earlier segment's backward pass: an executor may
        start it there, beside the rest of that backward pass and the next one.
    Returns:
      (the recompute FLOPs, the offloaded checkpoints copied back (once per segment
      reading one), the number of weight gradients made after the last segment).
    """
    graph, timeline, gradients = run.graph, run.timeline, run.gradients
    segmentation, forward = run.segmentation, run.forward
    order = segmentation.order
    starts, back, deferred, recomputed = [], [], [], []
    recompute = 0

    def recompute_through(last):
        nonlocal recompute
        while len(recomputed) <= min(last, len(order) - 1):
            local, cost = _recompute(run, len(recomputed), offloaded, starts, prefetch, back)
            recomputed.append(local)
            recompute += cost

    waits_for = ([schedule.segment_trigger(graph, run.setup.expected, segmentation, head)
                  for head in order] if ahead else None)
    prompt = _PromptSteps(run, segmentation.final_ops)
    for index in range(len(order)):
        if offloaded:  # (a step of its own only then: plain predictions stay as they were)
            starts.append(timeline.step(("segment", None, index)))
        for op, beside in schedule.backward_order(graph, segmentation.kept_before.get(index, [])):
            run.gradient_step(op, forward, ("kept", op, index), beside=beside)
            prompt.run_ready(("kept", index))
        recompute_through(index + 1 if ahead else index)
        view = Overlay(recomputed[index], forward, segmentation.reads_forward)
        recomputed[index] = None
        for op, beside in schedule.backward_order(graph, segmentation.ops[order[index]]):
            run.gradient_step(op, view, ("backward", op, index), deferred, beside)
            prompt.run_ready(("kept", index))
            while ahead and len(recomputed) < len(order) and gradients.complete(
                    waits_for[len(recomputed) - 1]):
                recompute_through(len(recomputed))
    _deferred_steps(run, deferred, prompt)
    for op in reversed(segmentation.final_ops):
        if op not in prompt.done:
            run.gradient_step(op, forward, ("final", op, None))
    # (weight gradients: not the filter gradients made last with them, deferred_through)
    return recompute, back, sum(1 for op, *_ in deferred if op in graph.deferred)


class _PromptSteps:
    """The gradient steps of final ops that TensorFlow takes as soon as their incoming
    gradient is complete: a variable read's, whose gradient is the incoming gradient
    itself (the rewrite sums it into the variable's without a gradient call). Counted
    after every segment, a Keras layer's weight gradient was alive from its segment to
    the step's end where the optimizer's update of that weight consumes it at once; in
    one region the replay placed those small buffers among the freed activations,
    whose holes no activation then fitted (capacity.py's 24 x Dense(256) MLP under
    Adam, 'memory' at batch 6940: 99.7 MiB predicted, 93.8 used, and 1.2x its answer
    ran under the 96-MiB cap)."""

    def __init__(self, run, final_ops):
        graph = run.graph
        self.run = run
        self.waiting = {}  # output tensor id -> op
        for op in final_ops:
            if _passes_gradient_through(graph, op):
                for tid in graph.outputs[op]:
                    self.waiting[tid] = op
        self.done = set()
        run.gradients.watch(self.waiting)

    def run_ready(self, where):
        """Takes the gradient steps whose incoming gradients were all completed, labelled
        as steps of `where` (phase, segment index): in a segment, as its steps of ops
        that are not recomputed."""
        gradients = self.run.gradients
        while gradients.completed:
            op = self.waiting.get(gradients.completed.popleft())
            if op is None or op in self.done or not gradients.complete(
                    self.run.graph.outputs[op]):
                continue
            self.done.add(op)
            phase, index = where
            self.run.gradient_step(op, self.run.forward, (phase, op, index),
                                   takes_a_thread=False)


def _passes_gradient_through(graph, op):
    """Whether op `op`'s gradient is its incoming gradient itself for each input it
    sends one to (a step that takes no thread: schedule.step_takes_a_thread), reading
    nothing: a variable read's, and a loose Identity's or Reshape's, which no kernel
    computes either (a view of the incoming gradient), so TensorFlow has it as soon as
    the incoming one is complete."""
    return (bool(graph.grad_inputs[op]) and not graph.grad_reads[op]
            and op not in graph.loops and not schedule.step_takes_a_thread(graph, op))


def _deferred_steps(run, deferred, prompt):
    """The gradients the rewrite makes after every segment, in the order it made
    their segments' backward passes; each keeps what it reads alive until then.
    They wait for the same tensors, so the executor runs as many side by side as it
    has threads (StepGraph.inter_op_threads): what each one reads and its
    temporaries (a filter gradient's im2col buffer) are alive through the next
    ones' steps. (Counted in steps that make temporaries, a filter gradient's: the
    Cast of its result to the weight's float32 takes no thread for long.)"""
    graph, timeline, gradients = run.graph, run.timeline, run.gradients
    steps = [timeline.step(("deferred", op, None)) for op, _, _, _ in deferred]
    working = [step for step, entry in zip(steps, deferred) if entry[3]]
    position = {step: index for index, step in enumerate(working)}
    side_by_side = max(graph.inter_op_threads, 1)
    for step, (op, pairs, held, temporaries) in zip(steps, deferred):
        until = step
        if temporaries:
            until = working[min(position[step] + side_by_side, len(working)) - 1]
            timeline.buffer(step, temporaries, "gradients", run.owners.of_op[op], end=until)
        for buffer in held:
            timeline.use(buffer, until)
        for tid in graph.outputs[op]:  # (made here where deferred through op)
            gradients.consume(tid, until)
        for tid, nbytes in pairs:
            gradients.contribute(tid, nbytes, step)
        prompt.run_ready(("deferred", None))


def _recompute(run, index, offloaded, starts, prefetch, back):
    """Segment `index`'s recomputation: (its Recomputed buffers, its cost). Its
    offloaded reads (appended to `back`) come back from the start of the segment
    `prefetch` earlier, or of the latest started (recomputing ahead)."""
    graph, timeline, forward, segmentation = run.graph, run.timeline, run.forward, run.segmentation
    ops = segmentation.ops[segmentation.order[index]]
    executed = segmentation.executed(segmentation.order[index])
    local = Recomputed()
    tensors = local.tensors
    of_tensor, of_op = run.owners.of_tensor, run.owners.of_op
    for tid in _outside_reads(graph, ops, executed, offloaded):
        back.append(tid)
        start = starts[min(max(index - prefetch, 0), len(starts) - 1)]
        tensors[tid] = timeline.buffer(start, graph.size[tid], "offloaded back", of_tensor[tid])
    narrowed = segmentation.reads_forward.narrowed
    narrowed_reads = _outside_reads(graph, ops, executed, narrowed)
    for tid in narrowed_reads:
        step = timeline.step(("recompute", graph.producer[tid], index))
        timeline.use(forward[narrowed[tid]], step)
        tensors[tid] = timeline.buffer(step, graph.size[tid], "recomputed", of_tensor[tid])
    for op in ops:
        if op not in executed:
            continue
        step = timeline.step(("recompute", op, index))
        for tid in graph.inputs[op]:
            timeline.use(tensors.get(tid, forward[tid]), step)
        for tid in graph.outputs[op]:
            source = graph.alias_of[tid]
            if source >= 0 and (source in tensors or tid not in graph.forwarded):
                tensors[tid] = tensors.get(source, forward[source])
            else:
                tensors[tid] = timeline.buffer(step, graph.size[tid], "recomputed",
                                               of_tensor[tid], pieces=graph.pieces.get(tid, 1))
        if op in graph.folded:
            local.folded[op] = timeline.buffer(step, graph.folded[op], "recomputed", of_op[op])
        if op in graph.held:
            local.held[op] = timeline.buffer(step, graph.held[op], "recomputed", of_op[op])
    return local, segment_cost(graph, ops, executed, narrowed_reads)


def segment_cost(graph, ops, executed, narrowed_reads):
    """What a segment's recomputation costs (memsave.planner.costs units): the segment's
    overhead, the Cast of each narrowed checkpoint it reads (`narrowed_reads`), and each
    of its `ops` it runs again (`executed`), with an op's overhead each (summed in this
    order: the same float)."""
    op_overhead = graph.costs.op_overhead
    cost = graph.costs.segment_overhead
    for tid in narrowed_reads:
        cost += graph.cost[graph.producer[tid]] + op_overhead
    for op in ops:
        if op in executed:
            cost += graph.cost[op] + op_overhead
    return cost


def plan_costs(graph, segmentation, offloaded=frozenset()):
    """(the recomputation's cost, the offloaded checkpoints copied back, once per
    segment reading one) of a plan, as run_segments finds them, without simulating it:
    a search ranks plans by cost before it simulates any."""
    recompute, back = 0, []
    narrowed = segmentation.reads_forward.narrowed
    for head in segmentation.order:
        ops, executed = segmentation.ops[head], segmentation.executed(head)
        recompute += segment_cost(graph, ops, executed,
                                  _outside_reads(graph, ops, executed, narrowed))
        back += _outside_reads(graph, ops, executed, offloaded)
    return recompute, back


def _outside_reads(graph, ops, executed, among):
    """The tensors of `among` (offloaded or narrowed checkpoints) made outside a
    segment that its recomputation or backward reads."""
    if not among:
        return []
    members = set(ops)
    reads = set()
    for op in ops:
        candidates = list(graph.grad_reads[op])
        if op in executed:
            candidates += graph.inputs[op]
        reads.update(t for t in candidates
                     if t in among and graph.producer[t] not in members)
    return sorted(reads)
