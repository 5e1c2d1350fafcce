"""The simulation of one training step: tf.gradients' or a plan's, as a Timeline.

`simulate` continues a simulated forward pass (memsave.planner.forward_pass) with the
backward pass and returns what it found (a SimulatedStep); it writes nothing onto the
MemoryModel, so a plan's answer depends on the plan alone. The steps:

- tf.gradients' step: each op's gradient, in the order an executor runs them
  (memsave.planner.schedule.backward_order);
- a plan's (memsave.planner.simulate_plan): segment by segment (last first), the
  segment's recomputation followed by its backward pass (where the plan recomputes
  ahead, each recomputation as soon as the gradient it waits for is complete, within
  an earlier segment's backward pass); a copy whose output nobody reads is never run
  (TensorFlow prunes it); a checkpoint made by a Cast to a wider type is held as the
  Cast's input, and each segment that reads it makes its own copy as it starts
  (ForwardReads.narrowed); then the weight gradients the rewrite makes last
  (StepGraph.deferred), as many side by side as the executor has threads; then the
  gradients of the ops no segment recomputes.

A gradient step reads what its op's gradient needs (StepGraph.grad_reads) and the
incoming gradients, makes its temporaries and its contributions to its inputs'
gradients (memsave.planner.timeline.Gradients). The kernel habits it knows, each
justified where it is applied: gradients that pass an incoming buffer through or write
into an input (StepGraph.gradient_into_output), elementwise gradients written into a
buffer read for the last time (timeline.forwarded_buffer), a convolution's im2col
workspaces split between its two gradients, a loop's per-iteration state or its
recomputing copy's carries, a nested call's backward function freeing what it reads
early, and steps of parallel branches running side by side on several inter-op threads.
"""

import dataclasses
from typing import Optional

from memsave.planner import opinfo, schedule, simulate_plan
from memsave.planner.segments import Segmentation
from memsave.planner.timeline import (BESIDE, FOREVER, THE_STEP, Gradients, Timeline,
                                      forwarded_buffer)


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """What every simulation of one step shares, whatever the plan.

    Attributes:
      graph: the StepGraph.
      expected: tensor id -> contributions its gradient gets
        (memsave.planner.timeline.contribution_counts).
      beside: the memsave.beside.Beside held beside the gradients, or None.
      recomputed_loops: the loop ops whose recomputing copies the rewrite
        differentiates (StepGraph.recomputed_loops).
      path_ops: the ops whose gradients tf.gradients makes (REGION and KEPT ops).
      owners: the step's memsave.planner.timeline.Owners (whose each buffer is).
      run_ahead_end: how far ahead TensorFlow runs the gradient loops it differentiates
        (memsave.planner.loops.LoopMemory.run_ahead's `end`; None: as counted).
    """
    graph: object
    expected: dict
    beside: object
    recomputed_loops: frozenset
    path_ops: list
    owners: object
    run_ahead_end: Optional[int] = None


@dataclasses.dataclass
class SimulatedStep:
    """What one simulation found.

    Attributes:
      timeline: the step's Timeline (its buffers and steps).
      segmentation: the plan's Segmentation, None for tf.gradients' step.
      recompute_flops: the recomputed copies' cost (memsave.planner.costs units).
      copied_back: the offloaded checkpoints copied back, once per segment reading one.
      deferred_gradients: weight gradients made after the last segment.
    """
    timeline: Timeline
    segmentation: Optional[Segmentation]
    recompute_flops: float = 0
    copied_back: list = dataclasses.field(default_factory=list)
    deferred_gradients: int = 0


def simulate(setup, forward_pass, segmentation=None, offloaded=frozenset(), prefetch=1,
             ahead=False):
    """Simulates one step after `forward_pass` (a memsave.planner.forward_pass.ForwardPass,
    left unchanged).

    Args:
      setup: the StepSetup.
      forward_pass: the step's forward pass for this plan's unforwardable outputs.
      segmentation: the plan's Segmentation; None simulates tf.gradients' step.
      offloaded: checkpoints kept in host memory (memsave.offload).
      prefetch: how many segments ahead an offloaded checkpoint comes back.
      ahead: whether each segment recomputes ahead (MemoryModel.predict's
        recompute_ahead).
    Returns:
      A SimulatedStep.
    """
    return _StepRun(setup, forward_pass, segmentation).run(offloaded, prefetch, ahead)


def _released_buffer(graph, op, origin, buffers, incoming, held):
    """The buffer of what call op `op`'s backward function reads, named as in
    BackwardRun.released (None where the step has none)."""
    kind, index = origin
    if kind == "incoming":
        return incoming[index] if index < len(incoming) else None
    if kind == "output":
        return buffers[graph.outputs[op][index]]
    return held


class _StepRun:
    """One simulation in progress: the per-run state, dropped when it returns."""

    def __init__(self, setup, forward_pass, segmentation):
        self.setup = setup
        self.graph = setup.graph
        self.segmentation = segmentation
        self.timeline = forward_pass.timeline.copy()
        self.forward = forward_pass.buffers
        self.loop_buffers = forward_pass.loop_buffers
        self.held_buffers = forward_pass.held_buffers
        self.folded_buffers = forward_pass.folded_buffers
        self.rewriting = segmentation is not None
        self.segment_of = {} if segmentation is None else segmentation.segment_of
        self.running = []  # [steps left, buffers] of gradient steps still running
        # (step, a contribution's buffer, the buffers it may be written into)
        self.written_into = []
        # (step, buffers a call's backward function frees early, (a buffer it writes a
        # temporary into, the buffer that temporary needs where that one lives on))
        self.call_runs = []
        self.owners = setup.owners
        self.gradients = Gradients(self.graph, self.timeline, setup.expected, setup.owners,
                                   setup.beside)

    def run(self, offloaded, prefetch, ahead):
        graph, timeline, gradients = self.graph, self.timeline, self.gradients
        if self.rewriting:
            self._drop_forward_buffers_of_copies()
        start = timeline.step(("seed", None, None))
        for tid, is_y in enumerate(graph.is_y):
            if is_y:
                gradients.seed(tid, start)
        result = SimulatedStep(timeline, self.segmentation)
        if self.segmentation is None:
            for op, beside in schedule.backward_order(graph, self.setup.path_ops):
                self.gradient_step(op, self.forward, ("backward", op, None), beside=beside)
        else:
            (result.recompute_flops, result.copied_back,
             result.deferred_gradients) = simulate_plan.run_segments(self, offloaded, prefetch,
                                                                     ahead)
        self._settle_call_runs()
        self._forward_gradients_into_dying()
        self._hold_beside()
        return result

    def _drop_forward_buffers_of_copies(self):
        """What the forward pass keeps for gradients the rewrite takes of recomputed
        copies instead (a plan's step only)."""
        timeline, segmentation = self.timeline, self.segmentation
        # The rewrite differentiates these loops' recomputing copies: the loops
        # themselves keep nothing for the backward pass.
        for op in self.setup.recomputed_loops:
            timeline.bytes[self.loop_buffers[op]] = 0
        # Nor do the ops whose gradients are taken of their recomputed copies.
        for ops in segmentation.ops.values():
            for op in ops:
                if op in self.held_buffers:
                    timeline.bytes[self.held_buffers[op]] = 0
        # A folded product is made of what the gradient reads: of the copy's
        # output where the copy runs, else of the forward pass's.
        for head in segmentation.order:
            for op in segmentation.executed(head):
                if op in self.folded_buffers:
                    timeline.bytes[self.folded_buffers[op]] = 0

    def _hold_beside(self):
        """What the training step holds beside the gradients: resident from the start,
        and, where the update waits for every gradient, its temporaries (of the largest
        weight) in a step of its own after the last gradient, while every gradient of
        an x is alive (they live FOREVER). (An update of each gradient as it is made is
        simulated as it arrives: Gradients._completed_x.)"""
        beside, graph, timeline = self.setup.beside, self.graph, self.timeline
        if beside is None:
            return
        for nbytes in beside.resident_sizes:
            timeline.buffer(0, nbytes, BESIDE, THE_STEP, FOREVER)
        largest = max((graph.size[t] for t, is_x in enumerate(graph.is_x) if is_x), default=0)
        if beside.update_temporaries and not beside.updates_each_gradient and largest:
            update = timeline.step(("update", None, None))
            timeline.buffer(update, int(beside.update_temporaries * largest), BESIDE, THE_STEP,
                            pieces=max(1, round(beside.update_temporaries)))

    # -- one gradient step ----------------------------------------------------------
    def gradient_step(self, op, buffers, label, deferred=None, beside=0, takes_a_thread=True):
        """One op's gradient, reading forward tensors from `buffers` (the forward
        pass's, or a segment's simulate_plan.Overlay). In a segment of the rewrite
        (`deferred` a list), the contributions the rewrite makes last
        (StepGraph.deferred) are left out and appended to `deferred` with the buffers
        they keep alive until then.
        `beside`: how many of the next gradient steps start while this one runs
        (schedule.backward_order): what it reads and its temporaries are alive
        through them. A step that does no work (`takes_a_thread` False: a variable
        read's, taken as soon as its gradient is complete) is not one of those."""
        graph, timeline = self.graph, self.timeline
        step = timeline.step(label)
        held_beside = self._run_beside(step) if takes_a_thread else frozenset()
        incoming = [self.gradients.consume(tid, step) for tid in graph.outputs[op]]
        reads, held = self._reads(op, buffers)
        for buffer in reads:
            timeline.use(buffer, step)
        self._note_call_run(op, step, buffers, incoming, held)
        loop_temporaries = self._loop_gradient(op, step, buffers)
        temporaries = graph.grad_temporaries[op] + loop_temporaries
        later = ()
        if deferred is not None:  # a segment of the rewrite
            temporaries = graph.rewrite_grad_temporaries.get(op, temporaries)
            through = schedule.made_last_through(graph, self.segment_of, op)
            later = tuple(graph.deferred.get(op, ())) + through
            if later:
                temporaries, temporaries_later = self._split_temporaries(op, later, temporaries)
                # (what a converted weight's gradient is made from: not the weight)
                converted = {buffers[tid] for tid, _ in through}
                deferred.append((op, later, [b for b in reads if b not in converted] + incoming,
                                 temporaries_later))
        # (A loop's gradient makes its temporaries iteration by iteration: as many
        # tensors as it runs iterations.)
        pieces = (graph.loops[op].iterations if loop_temporaries
                  else graph.temporary_pieces(op, temporaries))
        made = ([timeline.buffer(step, temporaries, "gradients", self.owners.of_op[op],
                                 pieces=pieces)]
                if temporaries else [])
        if beside:
            self.running.append([beside, reads + incoming + made])
        self._contribute(op, step, buffers, incoming, reads, held_beside, later)

    def _reads(self, op, buffers):
        """(the buffers op `op`'s gradient reads of the forward pass or its copy's run,
        what it keeps of that run (StepGraph.held) or None)."""
        graph = self.graph
        reads = [buffers[tid] for tid in graph.grad_reads[op]]
        overlay = buffers if isinstance(buffers, simulate_plan.Overlay) else None
        held = (overlay.recomputed.held.get(op) if overlay is not None
                else self.held_buffers.get(op))
        if held is not None:
            reads.append(held)
        folded = overlay.recomputed.folded.get(op) if overlay is not None else None
        if folded is None:
            folded = self.folded_buffers.get(op)
        if folded is not None:
            reads.append(folded)
        return reads, held

    def _note_call_run(self, op, step, buffers, incoming, held):
        """For a call op, what its backward function frees early and the temporaries it
        writes into buffers it reads (settled once every step is simulated:
        _settle_call_runs)."""
        graph, timeline = self.graph, self.timeline
        run = graph.call_runs.get(op)
        if run is None:
            return

        def buffer_of(origin):
            return _released_buffer(graph, op, origin, buffers, incoming, held)
        self.call_runs.append((step, [buffer_of(origin) for origin in run.released], [
            (buffer_of(origin), timeline.buffer(step, nbytes, "gradients", self.owners.of_op[op]))
            for origin, nbytes in run.temporaries_in_reads]))

    def _loop_gradient(self, op, step, buffers):
        """What a loop op's gradient adds to its temporaries (0 for other ops); reads
        what TensorFlow's gradient keeps of the loop, or runs the recomputing copy."""
        if op not in self.loop_buffers:
            return 0
        graph, timeline = self.graph, self.timeline
        timeline.use(self.loop_buffers[op], step)
        loop = graph.loops[op]
        # (The gradient loop frees what it kept of each iteration as it writes that
        # iteration's gradient into the lists the loop read: those take the place of
        # the copy's carries, or of as much of TensorFlow's run-ahead.)
        lists = sum(nbytes for tid, nbytes in graph.grad_inputs[op] if tid in graph.grad_pieces)
        if not (self.rewriting and op in self.setup.recomputed_loops):
            return max(0, loop.run_ahead(self.setup.run_ahead_end) - lists)
        # The copy runs the loop again here, reading what the loop read (an
        # RNN's input sequence), and keeps each iteration's carry apart.
        for tid in graph.inputs[op]:
            timeline.use(buffers[tid], step)
        carries = loop.carries * loop.carried
        timeline.buffer(step, carries - min(carries, lists), "gradients", self.owners.of_op[op],
                        pieces=loop.carries)
        return loop.kept_by_copy + loop.copy_run_ahead - carries

    def _contribute(self, op, step, buffers, incoming, reads, held_beside, later):
        """Op `op`'s contributions to its inputs' gradients, but those made `later`."""
        graph = self.graph
        into = graph.gradient_into_output(op)
        for tid, nbytes in graph.grad_inputs[op]:
            if later and (tid, nbytes) in later:
                continue
            shares = incoming[0] if incoming and graph.gradient_passes_through(op, tid) else None
            if into is not None and into[0] == tid:
                shares = buffers[into[1]]
            made_here = self.gradients.contribute(tid, nbytes, step, shares)
            if made_here is not None and (self._elementwise_gradient(op, nbytes)
                                          or self._written_by_call(op, tid)):
                self.written_into.append((step, made_here, [
                    b for b in reads + incoming if b is not None and b not in held_beside]))

    def _run_beside(self, step):
        """Gradient step `step` starts while the earlier ones that run beside it still
        run: what they read and their temporaries are alive through it too. Returns
        those buffers (still read by a step that runs on: none is this step's to write
        into)."""
        if not self.running:  # (a chain, and every step on one thread)
            return frozenset()
        held = set()
        for entry in self.running:
            entry[0] -= 1
            for buffer in entry[1]:
                self.timeline.use(buffer, step)
                held.add(buffer)
        self.running = [entry for entry in self.running if entry[0] > 0]
        return held

    def _split_temporaries(self, op, later, temporaries):
        """(the temporaries of op `op`'s gradient in its segment, those of its part made
        last): a convolution whose filter gradient is made last makes its filter
        gradient's im2col buffer then, and only its input gradient's in the segment."""
        graph = self.graph
        workspaces = graph.conv_workspaces.get(op)
        if workspaces is None or len(graph.inputs[op]) < 2 or not any(
                tid == graph.inputs[op][1] for tid, _ in later):
            return temporaries, temporaries
        for_filter, for_input = workspaces
        # (`temporaries` holds the larger of the two buffers: the rewrite makes the two
        # gradients one after the other, StepGraph.rewrite_grad_temporaries)
        others = temporaries - max(for_filter, for_input)
        return others + for_input, for_filter

    def _elementwise_gradient(self, op, nbytes):
        """Whether op `op`'s gradient makes a contribution of `nbytes` with an elementwise
        kernel (not a custom gradient; of the op's output's size: a broadcast input's is
        reduced by a Sum, which allocates)."""
        graph = self.graph
        return (op not in graph.custom_gradient_ops
                and graph.ops[op].type in opinfo.ELEMENTWISE_GRADIENTS
                and bool(graph.outputs[op]) and nbytes == graph.size[graph.outputs[op][0]])

    def _written_by_call(self, op, tid):
        """Whether call op `op`'s backward function writes the gradient of its input
        `tid` into a buffer it reads for the last time (BackwardRun.written_into)."""
        run = self.graph.call_runs.get(op)
        inputs = self.graph.inputs[op]
        return run is not None and any(inputs[i] == tid for i in run.written_into
                                       if i < len(inputs))

    # -- settled once every step is simulated ----------------------------------------
    def _settle_call_runs(self):
        """What a tf.function call's backward function reads for the last time before
        its peak (memsave.planner.call_gradients.BackwardRun) is freed by then where
        nothing reads it later: it ends the step before; a temporary it writes into such
        a buffer needs none of its own there. Done once every step is simulated, when
        each buffer's last reader is known; before contributions are written into dying
        buffers (a buffer freed here is none of those)."""
        timeline = self.timeline
        for step, released, written in self.call_runs:
            for buffer in released:
                if timeline.last_read_at(buffer, step):
                    timeline.ends[buffer] = step - 1
            for buffer, own in written:
                if timeline.last_read_at(buffer, step):
                    timeline.bytes[own] = 0

    def _forward_gradients_into_dying(self):
        """An elementwise op's gradient writes each contribution it makes into the buffer
        of a tensor of its size that it reads for the last time (the forward tensor, as
        TanhGrad writes into the tanh's output, else the incoming gradient): the rule
        is memsave.planner.timeline.forwarded_buffer's. Done once every step is
        simulated, when each buffer's last reader is known: the buffer taken ends the
        step before (the contribution's own buffer holds its bytes from there), each
        taken once."""
        timeline = self.timeline
        taken = set()
        for step, made, candidates in self.written_into:
            buffer = forwarded_buffer(timeline, [
                b for b in candidates
                if b not in taken and timeline.bytes[b] == timeline.bytes[made]], step)
            if buffer is not None:
                timeline.ends[buffer] = step - 1
                taken.add(buffer)
