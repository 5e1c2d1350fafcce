"""Step 1 of the rewrite: the forward region, the ops that may be recomputed.

The region is the set of ops on a path from xs to ys, in topological order,
without the ops that must never be re-executed: the xs' own ops, ops with no
inputs, and ops whose value could change if run twice (stateful ops such as
variable reads/assignments and random draws, and control-flow ops, whose
copies would not be valid). Those are decided by op type and op definition,
never by name.
"""

import logging
import math

import tensorflow as tf

from memsave.graph import _tf_private, calls
from memsave.graph.select import (
    TensorSet, get_backward_walk_ops, get_forward_walk_ops, topological_sort)

logger = logging.getLogger(__name__)

# Functional control flow and function calls: their bodies live in the function
# library and their gradients rely on Python-side state of the original op.
V1_CONTROL_FLOW_OP_TYPES = frozenset([
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
])
CONTROL_FLOW_OP_TYPES = frozenset([
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall",
]) | V1_CONTROL_FLOW_OP_TYPES
# Ops that read their inputs' shapes, not their values (Grappler folds them into
# constants where the shapes are known).
SHAPE_READER_OP_TYPES = frozenset(["Shape", "ShapeN", "Size", "Rank"])


NOT_RECOMPUTABLE = "not recomputable, so already kept"


def why_not_recomputable(op):
    """Why `op` must not be copied and run again, or None if it may be.

    Returns:
      A short reason string ('stateful', 'control flow', 'no inputs', or why a function
      call could give other outputs when run again), or None.
    """
    if _tf_private.control_flow_context(op) is not None:
        return "control flow"
    if calls.is_call(op):
        # A tf.function call runs its function again when copied: safe where that
        # function gives the same outputs a second time (no random or writing op).
        why = calls.why_call_not_repeatable(op)
        return None if why is None else f"a function call: {why}"
    if op.type in CONTROL_FLOW_OP_TYPES:
        return "control flow"
    if op.op_def is not None and op.op_def.is_stateful:
        return "stateful"
    if not op.inputs:
        return "no inputs"
    return None


def sized_dims(t, unknown_dim_size=1):
    """`t`'s dimensions with unknown ones counted as `unknown_dim_size` (a
    memsave.planner.shapes.UnknownDims first fills in those TensorFlow's shape inference
    gives once the step's inputs have that size); None where even the rank is unknown."""
    shape_of = getattr(unknown_dim_size, "shape_of", None)
    shape = shape_of(t) if shape_of is not None else t.shape
    if shape.rank is None:
        return None
    return [d if d is not None else int(unknown_dim_size) for d in shape.as_list()]


def estimated_bytes(t, unknown_dim_size=1):
    """Static size estimate of a tensor; unknown dimensions count as `unknown_dim_size`
    (sized_dims)."""
    size = t.dtype.size if t.dtype not in (tf.string, tf.resource, tf.variant) else 0
    dims = sized_dims(t, unknown_dim_size)
    return size if dims is None else math.prod(dims) * size


class ForwardRegion:
    """The recomputable ops between xs and ys, in topological order.

    Attributes:
      ops: region ops, topologically sorted (ties keep graph discovery order).
      position: op -> index in `ops`.
      xs, ys: the graph tensors the region was built for.
      kept_ops: ops on the path that are not recomputable, with the reason
        (their outputs are kept and read by the recomputed copies).
    """

    def __init__(self, ops, xs, ys, kept_ops):
        self.ops = ops
        self.position = {op: i for i, op in enumerate(ops)}
        self.op_set = frozenset(ops)
        self._path_ops = self.op_set | {op for op, _ in kept_ops}
        self.xs = xs
        self.ys = ys
        self.kept_ops = kept_ops
        self._xs_set = TensorSet(xs)
        self._ys_set = TensorSet(ys)
        self.cache = {}  # per-rewrite memo for strategies
        # Ops of xs that lie downstream of other xs: tf.gradients still sends
        # their gradient on to the xs upstream of them.
        self.dependent_x_ops = frozenset()
        # Ops making one of the call's stop_gradients.
        self.stopped_ops = frozenset()

    @classmethod
    def build(cls, ys, xs, stop_gradients=()):
        """Builds the region for gradients of `ys` with respect to `xs`.

        Args:
          ys, xs: lists of graph tensors of one graph.
          stop_gradients: the call's stop_gradients (a function call making one is kept:
            tf.gradients differentiates such a call through a SymbolicGradient op,
            which a copy of the call could not run).
        Returns:
          A ForwardRegion (possibly empty).
        """
        stopped_ops = {t.op for t in stop_gradients}
        backward = get_backward_walk_ops([y.op for y in ys], inclusive=True)
        on_path = get_forward_walk_ops(list(xs), inclusive=True, within_ops=backward)
        x_ops = {x.op for x in xs}
        region, kept, dependent_x_ops = [], [], []
        for op in on_path:
            if op in x_ops:
                # on_path is seeded with the xs' consumers, so an x op in it
                # depends on another x. It is never copied, but it is on the
                # path: its other outputs (e.g. the other halves of a split)
                # carry gradient to the xs upstream of it, so it is kept.
                dependent_x_ops.append(op)
                kept.append((op, "it computes one of the xs"))
                continue
            reason = why_not_recomputable(op)
            if reason is None and op in stopped_ops and calls.is_call(op):
                reason = "a function call whose output is in stop_gradients"
            if reason is None:
                region.append(op)
            else:
                kept.append((op, reason))
        ops = topological_sort(region)
        logger.debug("memsave: forward region has %d ops (%d kept as not recomputable)",
                     len(ops), len(kept))
        result = cls(ops, list(xs), list(ys), kept)
        result.dependent_x_ops = frozenset(dependent_x_ops)
        result.stopped_ops = frozenset(stopped_ops)
        return result

    def __contains__(self, op):
        return op in self.position

    def __len__(self):
        return len(self.ops)

    def is_x(self, t):
        return t in self._xs_set

    def is_y(self, t):
        return t in self._ys_set

    def depends_on_xs(self, t):
        """True if `t` is an x or is made by an op on a path from the xs."""
        return t.op in self._path_ops or self.is_x(t)

    def is_connected(self, x):
        """True if some y depends on `x` (structurally)."""
        return self.is_y(x) or any(c in self._path_ops for c in x.consumers())

    def why_outside(self, op):
        """Why an op that is not in the region is not there."""
        if op in self._path_ops:
            return NOT_RECOMPUTABLE
        return "it is not on a path from the xs to the ys"

    def tensors(self):
        """Output tensors of region ops, in topological order."""
        return [t for op in self.ops for t in op.outputs]

    def region_consumers(self, t):
        """Consumers of `t` that lie in the region."""
        return [c for c in t.consumers() if c in self.position]
