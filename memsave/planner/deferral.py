"""Weight gradients the rewrite makes after the last segment (StepGraph.deferred).

A weight's gradient is held from the step that makes it to the end of the backward
pass; where it is larger than what making it reads, the step holds less by keeping
those and making it last. StepGraph.build finds them once (`find_deferred`); the
memory model (memsave.planner.simulate_plan) and the rewrite both follow what it
records.
"""

from memsave.planner import opinfo
from memsave.planner.op_facts import types_where
from memsave.planner.op_kinds import KEPT, REGION, RESIDENT

# Ops whose gradient is their output's gradient, converted (the deferral follows a
# weight's gradient through them to the op that makes it: _held_if_deferred).
_CONVERTING_TYPES = types_where(lambda f: f.converts_gradient or f.aliases_input)


def find_deferred(step):
    """Records in `step` (a StepGraph: its `deferred`, `deferred_tensors` and
    `deferred_through`) the gradients worth computing last: a weight's gradient that is
    larger than what computing it reads.

    A gradient that leaves the graph where it is made (a variable's, or an x's) is
    only read at the end of the step, so once made it is held through the rest of
    the backward pass. If it is larger than the tensors its op reads to make it
    (the op's forward inputs and outputs' gradients, apart from weights, which
    are held anyway), the step holds less by keeping those and making it after the
    last segment: e.g. a 3x3 convolution of 512 channels at 3x3 pixels, whose
    filter gradient is 9.4 MB and whose input and output gradient are 0.3 MB each.
    Only where every op reading the tensor qualifies, and never for a sparse
    gradient (a gather's), which is as small as the rows it reads.
    """
    worth = {}  # tensor id -> ops whose gradient of it is worth deferring
    for op, pairs in enumerate(step.grad_inputs):
        if step.kind[op] != REGION:
            continue
        held = _held_if_deferred(step, op)
        sparse = opinfo.SPARSE_GRADIENT_INPUTS.get(step.ops[op].type, ())
        for tid, nbytes in pairs:
            dense = all(step.inputs[op][i] != tid for i in sparse
                        if i < len(step.inputs[op]))
            if dense and nbytes > held and _leaves_graph(step, tid):
                worth.setdefault(tid, []).append((op, nbytes))
    # The rewrite defers a tensor's gradient as a whole (one sum per segment), so
    # only where every op reading it would.
    for tid, found in worth.items():
        readers = {op for op in step.consumers[tid] if step.kind[op] == REGION
                   and any(t == tid for t, _ in step.grad_inputs[op])}
        if readers == {op for op, _ in found}:
            step.deferred_tensors.add(tid)
            for op, nbytes in found:
                step.deferred.setdefault(op, []).append((tid, nbytes))
    for op in sorted(step.deferred):
        _defer_through(step, op)


def _defer_through(step, op):
    """Where deferred op `op` converts what it reads (a Cast of a float32 weight to
    bfloat16), the rewrite makes last what makes its outputs' gradients too (the
    convolutions' filter gradients: `_held_if_deferred`): their contributions to
    those outputs are recorded in `deferred_through`."""
    outputs = step.outputs[op]
    readers = sorted({c for t in outputs for c in step.consumers[t]})
    if not (step.ops[op].type in _CONVERTING_TYPES and readers
            and all(step.kind[c] == REGION for c in readers)):
        return
    for reader in readers:
        pairs = [(t, nbytes) for t, nbytes in step.grad_inputs[reader] if t in outputs]
        if pairs:
            step.deferred_through.setdefault(reader, []).extend(pairs)
            _defer_through(step, reader)


def _held_if_deferred(step, op, made_from=()):
    """Bytes held to the end of the backward pass where op `op`'s gradient of a weight
    is made after the last segment: the non-resident tensors that gradient reads, and
    its outputs' gradients (one per output, of its size). Where `op` converts what it
    reads (a Cast, an identity: mixed precision reads a float32 weight through a Cast
    to bfloat16), its gradient is made from its readers' gradients, and the rewrite
    defers what makes those too (a convolution's filter gradient, reading the
    convolution's input and output gradient): what they hold counts instead, but for
    the converted weight itself (`made_from`), which no filter gradient reads."""
    outputs = step.outputs[op]
    readers = sorted({c for t in outputs for c in step.consumers[t]})
    if (step.ops[op].type in _CONVERTING_TYPES and readers
            and all(step.kind[c] == REGION for c in readers)):
        return sum(_held_if_deferred(step, c, outputs) for c in readers)
    held = sum(step.size[step.buffer_of(t)] for t in step.grad_reads[op]
               if t not in made_from
               and step.kind[step.producer[step.buffer_of(t)]] != RESIDENT)
    return held + sum(step.size[t] for t in outputs)


def _leaves_graph(step, tid):
    """Whether the gradient of `tid` is read by nothing but the step's result: `tid`
    is an x (but one computed from other xs, whose op the rewrite differentiates
    further with that gradient, memsave.backward), or a variable's value read by an
    op that is not recomputed."""
    producer = step.producer[tid]
    if step.is_x[tid]:
        return step.kind[producer] != KEPT
    return (step.kind[producer] == KEPT and bool(step.inputs[producer])
            and all(step.kind[step.producer[t]] == RESIDENT
                    for t in step.inputs[producer]))
