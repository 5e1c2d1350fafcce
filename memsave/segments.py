"""Step 2b: make sure no op is recomputed by more than one segment.

A segment copies everything between its checkpoint and the checkpoints below it.
If a tensor that is not a checkpoint is read by the ops of two segments, both
copy it and everything above it down to the next checkpoint. On a residual
stream that is not checkpointed (the 'speed' strategy keeps only matmul/conv
outputs; marks users put after a skip-add) every segment would then re-walk the
whole stream back to the start: quadratic recomputation, build time and memory.

`shared_tensors` finds, in one reverse-topological pass, the tensors read by more
than one segment; keeping them as checkpoints too bounds recomputation to one
copy of each region op.
"""

from memsave.graph.select import TensorSet

_SEVERAL = object()  # needed by more than one segment
_LAST = object()     # the segment that ends at the ys


def _merge(a, b):
    if a is None:
        return b
    if b is None or a is b:
        return a
    return _SEVERAL


def shared_tensors(region, checkpoints):
    """Region tensors that would be copied by more than one segment.

    Args:
      region: the ForwardRegion.
      checkpoints: the chosen checkpoint tensors.
    Returns:
      The tensors to keep as well (never xs or ys), in reverse topological order.
    """
    kept = TensorSet(checkpoints)
    segment_ops = {t.op for t in checkpoints}
    segment_of = {}  # op -> the segment that copies it (an op, _LAST, _SEVERAL) or None
    shared = []
    for op in reversed(region.ops):
        needs = [(t, _need(t, region, segment_of)) for t in op.outputs if t not in kept]
        segment = op if op in segment_ops else None
        for _, need in needs:
            segment = _merge(segment, need)
        if segment is _SEVERAL:
            promotable = [t for t, need in needs if need is not None and not region.is_y(t)]
            shared.extend(promotable)
            for t in promotable:
                kept.add(t)
            if promotable:
                segment_ops.add(op)
            if not any(need is not None and region.is_y(t) for t, need in needs):
                segment = op
        segment_of[op] = segment
    return shared


def _need(t, region, segment_of):
    """The segment(s) whose copies read tensor `t`."""
    need = _LAST if region.is_y(t) else None
    for consumer in region.region_consumers(t):
        need = _merge(need, segment_of[consumer])
    return need
