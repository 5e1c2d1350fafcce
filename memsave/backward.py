"""The parts the rewrite differentiates, and the one order that calls each gradient once.

tf.gradients calls every op's gradient function once, with the sum of all the
gradients that reach the op. A `tf.custom_gradient` need not be linear in that sum
(gradient clipping is the common case), so differentiating an op twice with parts of
its gradient and adding the results is wrong, not just rounding.

The rewrite differentiates the forward pass in parts, each with one `tf.gradients`
call (a `Part`):
- a segment: the recomputed copies between its checkpoints (or the ys) and the
  checkpoints below; it needs the whole gradient of the tensors it ends at and sends
  gradient to the tensors it reads from outside (checkpoints, xs, kept outputs);
- a kept part: ops that are never recomputed (a `tf.cond`, a `tf.while_loop`, a
  stateful op; the ops of one v1 control-flow construct together, whose gradients
  must be built in one call), differentiated once, as they are, with the whole
  gradient of their outputs.
Every tensor a kept part reads from the region, and every y that region ops read, is a
checkpoint (StepGraph.boundaries, added to every plan), so no segment needs a gradient
in its middle; a y's gradient starts as its grad_y.

`backward_order` orders the parts so that each is differentiated only once every
part sending gradient to what it needs has been: then each receives its whole
gradient. Where no such order exists, or a gradient would reach a tensor no part
takes (a kept op reading a tensor inside a segment), it raises `NoBackwardOrder`
before anything is built, and plain tf.gradients answers the call.
"""

import dataclasses
from typing import Optional

import tensorflow as tf

from memsave.graph import _tf_private, calls
from memsave.graph.select import TensorSet, get_backward_walk_ops
from memsave.region import V1_CONTROL_FLOW_OP_TYPES

# v1 TensorArray ops: their gradients meet through a gradient TensorArray that each
# tf.gradients call names after itself, so the ops writing one and the ops reading it
# (a loop and the unstack or stack around it) must be differentiated in one call.
_TENSOR_ARRAY_OP_TYPES = frozenset(
    f"TensorArray{verb}{version}" for version in ("V2", "V3")
    for verb in ("", "Write", "Read", "Scatter", "Gather", "Split", "Concat", "Size", "Grad",
                 "GradWithShape", "Close", "Pack", "Unpack"))

SEGMENT = "segment"
KEPT = "kept"


class NoBackwardOrder(Exception):
    """No order of the parts gives every gradient function its whole gradient (the
    message says why); raised before anything is added to the graph."""


@dataclasses.dataclass
class Part:
    """One `tf.gradients` call of the rewrite.

    Attributes:
      kind: SEGMENT or KEPT.
      ends_at: the tensors whose whole gradient it needs (a segment's checkpoints, the
        ys for the last one; a kept part's outputs read outside it).
      ops: the ops it differentiates (a segment's originals, which it copies).
      reads: the tensors outside it that it sends gradient to.
      position: where it lies in the forward pass (larger is later): ties in the order
        go to the later part, as a backward pass runs.
      checkpoint_group: a segment's checkpoints (None for the last segment and kept parts).
    """
    kind: str
    ends_at: list
    ops: list
    reads: list
    position: int
    checkpoint_group: Optional[list] = None

    @property
    def is_last_segment(self):
        return self.kind == SEGMENT and self.checkpoint_group is None


def differentiable(t):
    """Whether a gradient can flow into `t`: floating or complex values, a variable
    handle (whose gradient is its variable's), or a variant (a TensorList's gradient is
    one: a loop's accumulated outputs)."""
    return (t.dtype.is_floating or t.dtype.is_complex
            or t.dtype in (tf.resource, tf.variant))


def needed_ops(ends_at, segment, checkpoints):
    """The ops of `segment` (a planned segment's ops) that `ends_at` needs: all of them
    where it ends at all its checkpoints; fewer where some of them get no gradient."""
    return get_backward_walk_ops([t.op for t in ends_at], inclusive=True,
                                 within_ops=segment, stop_at_ts=checkpoints)


def segment_reads(ops, region, checkpoints):
    """Tensors read by `ops` from outside them that carry gradient to the xs: checkpoints,
    xs, and outputs of path ops that are not recomputed (a segment's local inputs)."""
    members = set(ops)
    found = TensorSet()
    result = []
    for op in ops:
        for t in op.inputs:
            if t.op in members or t in found:
                continue
            if t.dtype == tf.resource and not calls.is_call(op):
                continue  # (a read's copy gives its handle no gradient; a call's does)
            if t in checkpoints or region.depends_on_xs(t):
                found.add(t)
                result.append(t)
    return result


def kept_groups(region, skip):
    """The ops the rewrite keeps whole, in groups differentiated together: each op alone,
    but the connected ops of one v1 control-flow construct (a cond's Switch, branch ops
    and Merge; a loop's frame) and the v1 TensorArray ops around it together, whose
    gradients tf.gradients builds in one call. Ops for which `skip(op)` holds are left out. Groups are lists of
    ops in the region's order of kept ops."""
    ops = [op for op, _ in region.kept_ops if not skip(op)]
    index = {op: i for i, op in enumerate(ops)}
    parent = list(range(len(ops)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, op in enumerate(ops):
        for t in op.inputs:
            j = index.get(t.op)
            if j is not None and _differentiated_together(op) and _differentiated_together(t.op):
                parent[root(i)] = root(j)
    groups = {}
    for i, op in enumerate(ops):
        groups.setdefault(root(i), []).append(op)
    return [groups[r] for r in sorted(groups)]


def _differentiated_together(op):
    """Whether `op` is part of a v1 control-flow construct or a v1 TensorArray, whose
    gradients tf.gradients builds together with those of the ops it is connected to."""
    return (op.type in V1_CONTROL_FLOW_OP_TYPES or op.type in _TENSOR_ARRAY_OP_TYPES
            or _tf_private.control_flow_context(op) is not None)


def kept_part(group, region, ys, position):
    """The Part of a group of kept ops: it needs the gradients of its outputs that are
    read outside it (or are ys) and sends gradient to what it reads from outside that
    depends on the xs. None where nothing it makes carries a gradient."""
    members = set(group)
    ys = TensorSet(ys)
    ends_at = [t for op in group for t in op.outputs if differentiable(t)
               and (t in ys or any(c not in members for c in t.consumers()))]
    if not ends_at:
        return None
    reads, seen = [], TensorSet()
    for op in group:
        for t in op.inputs:
            if t.op in members or t in seen or not differentiable(t):
                continue
            if region.depends_on_xs(t):
                seen.add(t)
                reads.append(t)
    return Part(KEPT, ends_at, list(group), reads, position)


def backward_order(parts, taken_at_the_end):
    """`parts` in an order in which each comes after every part that sends gradient to
    a tensor it ends at; ties go to the part latest in the forward pass.

    Args:
      parts: the Parts of one rewrite.
      taken_at_the_end: tensor -> whether its gradient is summed into the result
        (an x, or a read of a variable that is one), not taken by a part.
    Returns:
      The parts, reordered.
    Raises:
      NoBackwardOrder: where some gradient reaches a tensor that no part ends at and
        that is not an x, or the parts wait for each other in a circle.
    """
    owner = {}  # tensor key -> index of the part that ends at it
    for i, part in enumerate(parts):
        for t in part.ends_at:
            owner.setdefault(t.ref(), i)
    waits = [set() for _ in parts]  # part index -> parts it waits for
    for i, part in enumerate(parts):
        for t in part.reads:
            j = owner.get(t.ref())
            if j is None:
                if taken_at_the_end(t):
                    continue
                raise NoBackwardOrder(
                    f"the gradient {_describe(part)} sends to {t.name} would reach no part "
                    "of the rewrite")
            if j == i:
                raise NoBackwardOrder(f"{_describe(part)} reads a tensor it ends at, {t.name}")
            waits[j].add(i)
    return [parts[i] for i in _ordered(parts, waits)]


def _ordered(parts, waits):
    """Indices of `parts`, each after those it waits for, latest position first among
    those ready (a list scan: rewrites have tens to hundreds of parts)."""
    remaining = [len(w) for w in waits]
    waited_by = [[] for _ in parts]
    for j, ws in enumerate(waits):
        for i in ws:
            waited_by[i].append(j)
    ready = [i for i, n in enumerate(remaining) if n == 0]
    result = []
    while ready:
        best = max(ready, key=lambda i: (parts[i].position, -i))
        ready.remove(best)
        result.append(best)
        for j in waited_by[best]:
            remaining[j] -= 1
            if remaining[j] == 0:
                ready.append(j)
    if len(result) < len(parts):
        circle = [_describe(parts[i]) for i, n in enumerate(remaining) if n > 0]
        raise NoBackwardOrder("the parts of the rewrite wait for each other in a circle: "
                              + ", ".join(circle[:4]) + (" ..." if len(circle) > 4 else ""))
    return result


def _describe(part):
    if part.kind == KEPT:
        return f"the kept op {part.ops[0].name}"
    if part.is_last_segment:
        return "the last segment"
    return f"the segment ending at {part.ends_at[0].name}"


def parts_of(region, ys, checkpoints, checkpoint_groups, position_of, skip_kept, segment_of):
    """Every Part of a rewrite, unordered.

    Args:
      region: the ForwardRegion.
      ys: the call's ys.
      checkpoints: a TensorSet of the plan's checkpoints.
      checkpoint_groups: lists of checkpoints made by one op, in topological order.
      position_of: op -> its index in a topological order of the step's ops.
      segment_of: (the checkpoints of one group, or None for the last segment) -> the
        region ops of that segment, producers first (the planner's Segmentation).
      skip_kept: op -> whether a kept op is not differentiated by a part of its own
        (a read of a variable that is one of the xs: its gradient is the variable's).
    Returns:
      A list of Parts.
    """
    parts = []
    inside = [y for y in ys if y.op in region and y not in checkpoints]
    if inside:
        ops = segment_of(None)
        parts.append(Part(SEGMENT, inside, ops, segment_reads(ops, region, checkpoints),
                          position=1 << 62))
    for group in checkpoint_groups:
        ops = segment_of(group)
        parts.append(Part(SEGMENT, list(group), ops, segment_reads(ops, region, checkpoints),
                          position=position_of(group[0].op), checkpoint_group=list(group)))
    for group in kept_groups(region, skip_kept):
        part = kept_part(group, region, ys, max(position_of(op) for op in group))
        if part is not None:
            parts.append(part)
    return parts

