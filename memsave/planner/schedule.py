"""The order in which a simulated backward pass runs its steps.

Pure functions of the StepGraph (and a plan's Segmentation): the order an executor
runs gradient steps in, which of them run side by side, what a segment's recomputation
waits for, and which contributions are made after every segment. They decide no
buffer: memsave.planner.simulate runs the steps in this order.
"""

import collections

from memsave.planner.segments import LAST


def backward_order(graph, ops):
    """The gradient steps of `ops` (producers first) in the order an executor
    runs them: each as soon as the gradients of all its outputs are complete,
    first come first served, so parallel branches interleave.

    Returns:
      [(op, beside)]: `beside` is how many of the steps after it start while it runs:
      those already waiting when it starts (independent of it: another branch's) that
      take a thread (`step_takes_a_thread`), as many as the executor has further threads
      (StepGraph.inter_op_threads); 0 in a chain, and for a step that takes none.
    """
    members = set(ops)
    waiting = {}
    for op in ops:
        for tid, _ in graph.grad_inputs[op]:
            producer = graph.producer[tid]
            if producer in members:
                waiting[producer] = waiting.get(producer, 0) + 1
    ready = collections.deque(op for op in reversed(ops) if op not in waiting)
    further_threads = max(graph.inter_op_threads, 1) - 1
    order = []
    takes_a_thread = {}  # (each op asked once: several steps may wait at a time)

    def working(op):
        if op not in takes_a_thread:
            takes_a_thread[op] = step_takes_a_thread(graph, op)
        return takes_a_thread[op]
    while ready:
        op = ready.popleft()
        beside = 0
        if further_threads and working(op):
            beside = min(sum(1 for other in ready if working(other)), further_threads)
        order.append((op, beside))
        for tid, _ in graph.grad_inputs[op]:
            producer = graph.producer[tid]
            if producer in members:
                waiting[producer] -= 1
                if waiting[producer] == 0:
                    ready.append(producer)
    if len(order) < len(ops):  # a cycle: keep what was ordered, then the rest
        done = {op for op, _ in order}
        order += [(op, 0) for op in reversed(ops) if op not in done]
    return order


def step_takes_a_thread(graph, op):
    """Whether op `op`'s gradient step does work another step could run beside: not
    where it makes no temporaries and each contribution is its incoming gradient itself
    (a variable read's, an identity's). Counted as running beside, a Keras MLP's variable
    reads kept each layer's activation alive a step longer: its fit step at batch 2497 was
    predicted 86.4 MiB for 83.1 measured (83.9 so; AMD EPYC without AVX-512)."""
    return bool(graph.grad_temporaries[op]) or not all(
        graph.gradient_passes_through(op, tid) for tid, _ in graph.grad_inputs[op])


def segment_trigger(graph, expected, segmentation, head):
    """The tensor ids whose gradients segment `head`'s copies wait for (the rewrite's
    trigger: the gradients of the checkpoints its head op makes); empty where none
    gets a gradient (`expected`: memsave.planner.timeline.contribution_counts), or
    for the last segment (it waits for the forward pass)."""
    if head == LAST:
        return []
    return [t for t in graph.outputs[head]
            if t in segmentation.checkpoints and expected.get(t, 0) > 0]


def made_last_through(graph, segment_of, op):
    """The contributions of op `op`'s gradient made last with a converted weight's
    (StepGraph.deferred_through): only where the op converting it (the Cast) is in
    the same segment (`segment_of`: Segmentation.segment_of), whose tf.gradients call
    makes them both; a Cast that heads a segment of its own (its output a checkpoint)
    gets its gradient from `op`'s."""
    return tuple((tid, nbytes) for tid, nbytes in graph.deferred_through.get(op, ())
                 if segment_of.get(graph.producer[tid]) == segment_of.get(op))
