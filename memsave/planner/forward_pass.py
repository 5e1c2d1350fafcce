"""The simulated forward pass: every forward op run once, in the graph's order.

The forward pass is the same for every plan but where a plan keeps a buffer a kernel
would otherwise write into (`unforwardable_outputs`), so memsave.planner.memory
simulates it once per such set and each plan's simulation (memsave.planner.simulate)
continues on a copy of its timeline.
"""

import dataclasses

from memsave.planner.graph import RESIDENT
from memsave.planner.timeline import FOREVER, Timeline


@dataclasses.dataclass
class ForwardPass:
    """One simulated forward pass.

    Attributes:
      timeline: its Timeline (copied by each plan's simulation, never changed after).
      buffers: per tensor id, its buffer in the timeline.
      loop_buffers: loop op id -> the buffer of what TensorFlow's gradient keeps of it.
      held_buffers: op id -> the buffer of what its gradient keeps that no tensor shows
        (StepGraph.held: a call's intermediates).
      folded_buffers: op id -> the buffer of its folded product (StepGraph.folded).
    """
    timeline: Timeline
    buffers: list
    loop_buffers: dict
    held_buffers: dict
    folded_buffers: dict


def unforwardable_outputs(graph, segmentation):
    """The forwarded outputs (StepGraph.forwarded) whose input's buffer the plan
    keeps for later (a checkpoint shares it): TensorFlow forwards a buffer only
    where nothing else will read it, so their kernels allocate. (None for
    tf.gradients' step: nothing is kept for later.) Not a checkpoint no copy that
    runs reads (Segmentation.read_by_a_copy): a language model's logits, read by the
    bias add and the loss, whose copies never run where the plan reads its last
    segment from the forward pass and the bias add's gradient reads neither, are
    forwarded into the loss's backprop as under tf.gradients."""
    if segmentation is None or not graph.forwarded:
        return frozenset()
    unforwardable, held = set(), segmentation.reads_forward.held
    for out in sorted(graph.forwarded):  # (producers first: a chain stops at one)
        tid = graph.alias_of[out]
        while tid >= 0:
            if tid in held and segmentation.read_by_a_copy(tid):
                unforwardable.add(out)
                break
            if tid in unforwardable:
                break
            tid = graph.alias_of[tid]
    return frozenset(unforwardable)


def run_forward(graph, unforwardable, owners):
    """Runs every forward op of `graph`, where the kernels of `unforwardable`
    (forwarded outputs) allocate their outputs; `owners`: the step's
    memsave.planner.timeline.Owners. Returns a ForwardPass."""
    timeline = Timeline()
    run = ForwardPass(timeline, [None] * len(graph.tensors), {}, {}, {})
    buffers = run.buffers
    for op, kind in enumerate(graph.kind):
        step = 0 if kind == RESIDENT else timeline.step(("forward", op, None))
        for tid in graph.inputs[op]:
            timeline.use(buffers[tid], step)
        for tid in graph.outputs[op]:
            source = graph.alias_of[tid]
            if source >= 0 and buffers[source] is not None and tid not in unforwardable:
                buffers[tid] = buffers[source]
            else:
                buffers[tid] = timeline.buffer(
                    step, graph.size[tid], "resident" if kind == RESIDENT else "forward",
                    owners.of_tensor[tid], FOREVER if kind == RESIDENT else None,
                    graph.pieces.get(tid, 1))
        loop = graph.loops.get(op)
        if loop is not None:
            run.loop_buffers[op] = timeline.buffer(
                step, loop.kept_by_tensorflow, "loop", owners.of_op[op], pieces=loop.iterations)
        if op in graph.held:
            run.held_buffers[op] = timeline.buffer(step, graph.held[op], "forward",
                                                   owners.of_op[op])
        if op in graph.folded:
            run.folded_buffers[op] = timeline.buffer(step, graph.folded[op], "forward",
                                                     owners.of_op[op])
    return run
