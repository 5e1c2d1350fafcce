"""Walks and filters over a live `tf.Graph` or FuncGraph.

Vocabulary shared by every walk (as in the old `tf.contrib.graph_editor`):
  seed_ops:   where a walk starts (ops, or tensors standing for their ops);
  within_ops: when given, the walk never leaves this set of ops;
  stop_at_ts: tensors the walk does not cross;
  inclusive:  whether the seed ops themselves are part of the result.

Results are lists in a deterministic order (the order ops are discovered), never
sets: the same graph gives the same answer every time. Tensors are unhashable in
a FuncGraph, so tensors are keyed with `tensor_key`.
"""

import collections
import re

import tensorflow as tf

from memsave.graph import _tf_private


def tensor_key(t):
    """A hashable key for a graph tensor (works in FuncGraphs, where tensors are unhashable).

    Args:
      t: a graph tensor.
    Returns:
      `(t.op, t.value_index)`, equal for every Python object standing for `t`.
    """
    return (t.op, t.value_index)


class TensorSet:
    """An insertion-ordered set of tensors, keyed by `tensor_key`."""

    def __init__(self, tensors=()):
        self._items = {}
        for t in tensors:
            self.add(t)

    def add(self, t):
        self._items.setdefault(tensor_key(t), t)

    def __contains__(self, t):
        return tensor_key(t) in self._items

    def __iter__(self):
        return iter(self._items.values())

    def __len__(self):
        return len(self._items)


class TensorMap:
    """An insertion-ordered dict from tensors to values, keyed by `tensor_key`."""

    def __init__(self, pairs=()):
        self._items = {}
        for t, value in pairs:
            self[t] = value

    def __setitem__(self, t, value):
        self._items[tensor_key(t)] = (t, value)

    def __getitem__(self, t):
        return self._items[tensor_key(t)][1]

    def get(self, t, default=None):
        item = self._items.get(tensor_key(t))
        return default if item is None else item[1]

    def __contains__(self, t):
        return tensor_key(t) in self._items

    def __len__(self):
        return len(self._items)

    def keys(self):
        return [t for t, _ in self._items.values()]

    def items(self):
        return list(self._items.values())


def _unique_ops(ops):
    return list(dict.fromkeys(ops))


def _as_list(value):
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (set, frozenset)):
        raise TypeError("memsave.graph: got a set, whose order is arbitrary; pass a list or tuple")
    return [value]


def make_list_of_op(ops, allow_tensors=True, ignore_ts=False):
    """Normalises ops, a graph, or (if allowed) tensors to a list of unique ops.

    Args:
      ops: an op, a tensor, a `tf.Graph`, or a list/tuple of ops and tensors.
      allow_tensors: if True, a tensor stands for the op that produces it.
      ignore_ts: if True, tensors are silently dropped instead of converted.
    Returns:
      A list of `tf.Operation`, in first-seen order, without duplicates.
    Raises:
      TypeError: for anything that is not an op, tensor or graph.
    """
    if isinstance(ops, tf.Graph):
        return ops.get_operations()
    result = []
    for item in _as_list(ops):
        if isinstance(item, tf.Operation):
            result.append(item)
        elif isinstance(item, tf.Tensor) and not _tf_private.is_eager_tensor(item):
            if ignore_ts:
                continue
            if not allow_tensors:
                raise TypeError(f"memsave.graph: expected ops, got tensor {item.name}")
            result.append(item.op)
        else:
            raise TypeError(f"memsave.graph: expected tf.Operation or graph tensor, got {type(item).__name__}")
    return _unique_ops(result)


def make_list_of_t(ts, allow_ops=False, ignore_ops=False, allow_duplicates=False):
    """Normalises tensors (or, if allowed, ops standing for their outputs) to a list.

    Args:
      ts: a tensor, an op, a `tf.Graph`, or a list/tuple of them.
      allow_ops: if True, an op stands for all its outputs.
      ignore_ops: if True, ops are silently dropped.
      allow_duplicates: if True, keep every item where it is (positions matter,
        e.g. for the pairs of `reroute_ts`); otherwise drop repeats.
    Returns:
      A list of graph tensors, in first-seen order.
    Raises:
      TypeError: for anything else.
    """
    if isinstance(ts, tf.Graph):
        return [t for op in ts.get_operations() for t in op.outputs]
    result = []
    for item in _as_list(ts):
        if isinstance(item, tf.Operation):
            if ignore_ops:
                continue
            if not allow_ops:
                raise TypeError(f"memsave.graph: expected tensors, got op {item.name}")
            result.extend(item.outputs)
        elif isinstance(item, tf.Tensor) and not _tf_private.is_eager_tensor(item):
            result.append(item)
        else:
            raise TypeError(f"memsave.graph: expected a graph tensor, got {type(item).__name__}")
    return result if allow_duplicates else list(TensorSet(result))


def make_op_membership(ops):
    """A set of ops for membership tests only (`can_modify`, `within_ops`, ...).

    Unlike `make_list_of_op` it accepts sets, since the order of a membership
    test does not matter.

    Args:
      ops: ops and/or tensors (standing for their producers), in any iterable,
        or a single op, tensor or graph.
    Returns:
      A `set` of `tf.Operation`.
    Raises:
      TypeError: for anything that is not an op, tensor or graph.
    """
    if isinstance(ops, frozenset) and isinstance(next(iter(ops), None), (tf.Operation, type(None))):
        # A frozenset of ops is taken as it is, unchecked and uncopied: the rewrite
        # walks within the same region once per segment.
        return ops
    if isinstance(ops, (set, frozenset)):
        ops = list(ops)
    elif not isinstance(ops, (tf.Graph, tf.Operation, tf.Tensor, list, tuple)):
        ops = list(ops)
    return set(make_list_of_op(ops))


def _tensor_membership(ts):
    """A TensorSet of `ts` for membership tests (accepts sets and other iterables)."""
    if isinstance(ts, TensorSet):
        return ts  # already keyed for membership; no copy
    if isinstance(ts, (set, frozenset)) or not isinstance(
            ts, (tf.Graph, tf.Operation, tf.Tensor, list, tuple)):
        ts = list(ts)
    return TensorSet(make_list_of_t(ts, allow_ops=False))


def get_consuming_ops(ts):
    """Ops that read any of `ts`.

    Args:
      ts: tensors, or ops standing for all their outputs.
    Returns:
      A list of ops without duplicates, in first-seen order.
    """
    return _unique_ops(op for t in make_list_of_t(ts, allow_ops=True) for op in t.consumers())


def get_generating_ops(ts):
    """Ops that produce `ts`.

    Args:
      ts: tensors (ops are taken as they are).
    Returns:
      A list of ops without duplicates, in first-seen order.
    """
    return _unique_ops(t.op for t in make_list_of_t(ts, allow_ops=True))


def _walk(seed_ops, next_ops, inclusive, within_ops):
    """Breadth-first walk; `next_ops(op)` yields the neighbours to visit."""
    seeds = make_list_of_op(seed_ops)
    within = None if within_ops is None else make_op_membership(within_ops)
    if within is not None:
        seeds = [op for op in seeds if op in within]
    visited = dict.fromkeys(seeds)
    queue = collections.deque(seeds)
    result = list(seeds) if inclusive else []
    while queue:
        for neighbour in next_ops(queue.popleft()):
            if neighbour in visited or (within is not None and neighbour not in within):
                continue
            visited[neighbour] = None
            result.append(neighbour)
            queue.append(neighbour)
    return result


def get_backward_walk_ops(seed_ops, inclusive=True, within_ops=None, stop_at_ts=(),
                          control_inputs=False):
    """Ops reachable from `seed_ops` by walking inputs backwards.

    Args:
      seed_ops: ops or tensors to start from.
      inclusive: include the seed ops in the result.
      within_ops: if given, only these ops are visited.
      stop_at_ts: tensors the walk does not cross (their producers are not
        reached through them).
      control_inputs: also follow control inputs.
    Returns:
      A list of ops in discovery order.
    """
    stop = _tensor_membership(stop_at_ts)

    def inputs_of(op):
        producers = [t.op for t in op.inputs if t not in stop]
        if control_inputs:
            producers.extend(op.control_inputs)
        return producers

    return _walk(seed_ops, inputs_of, inclusive, within_ops)


def get_forward_walk_ops(seed_ops, inclusive=True, within_ops=None, stop_at_ts=(),
                         control_outputs=False):
    """Ops reachable from `seed_ops` by walking consumers forwards.

    Args:
      seed_ops: ops or tensors to start from. A tensor seeds the walk with its
        consumers only (not with the op that produced it).
      inclusive: include the seed ops in the result.
      within_ops: if given, only these ops are visited.
      stop_at_ts: tensors the walk does not cross.
      control_outputs: also follow control outputs.
    Returns:
      A list of ops in discovery order.
    Raises:
      TypeError: if a seed is not an op or a graph tensor.
    """
    stop = _tensor_membership(stop_at_ts)
    seeds = []
    for item in ([seed_ops] if isinstance(seed_ops, tf.Graph) else _as_list(seed_ops)):
        if isinstance(item, tf.Tensor) and not _tf_private.is_eager_tensor(item):
            if item not in stop:
                seeds.extend(item.consumers())
        else:
            seeds.extend(make_list_of_op(item, allow_tensors=False))

    def consumers_of(op):
        consumers = [c for t in op.outputs if t not in stop for c in t.consumers()]
        if control_outputs:
            consumers.extend(_tf_private.control_outputs(op))
        return consumers

    return _walk(seeds, consumers_of, inclusive, within_ops)


def topological_sort(ops):
    """Returns `ops` sorted so every op comes after its producers within the set.

    Order among independent ops follows the input order, so the result is
    deterministic. Control inputs inside the set are respected too.

    Args:
      ops: ops (or tensors standing for their producers), or a graph.
    Returns:
      A list of the same ops.
    Raises:
      ValueError: if the ops contain a cycle (a v1 while loop's back edge).
    """
    ops = make_list_of_op(ops)
    members = set(ops)
    pending = {}
    consumers = collections.defaultdict(list)
    for op in ops:
        producers = _unique_ops(p for p in [t.op for t in op.inputs] + list(op.control_inputs)
                                if p in members)
        pending[op] = len(producers)
        for p in producers:
            consumers[p].append(op)
    ready = collections.deque(op for op in ops if pending[op] == 0)
    result = []
    while ready:
        op = ready.popleft()
        result.append(op)
        for c in consumers[op]:
            pending[c] -= 1
            if pending[c] == 0:
                ready.append(c)
    if len(result) != len(ops):
        raise ValueError("memsave.graph: the ops contain a cycle and have no topological order")
    return result


# A v1 while loop's back edge enters its NextIteration op; cycles through it are the loop.
BACK_EDGE_OP_TYPES = frozenset(["NextIteration", "RefNextIteration"])


def get_ops_on_cycles(seed_ops):
    """Ops on a cycle (data and control edges) among the ops reachable forwards from
    `seed_ops`; v1 while loops' back edges (every edge into a NextIteration) do not count.

    Every cycle through a seed op is found; a graph whose only changes are the seed ops
    and edges into them is acyclic exactly when this is empty.

    Args:
      seed_ops: ops or tensors to start from.
    Returns:
      A list of ops in discovery order (empty when there is no cycle).
    """
    ops = get_forward_walk_ops(seed_ops, inclusive=True, control_outputs=True)
    members = set(ops)

    def producers(op):
        if op.type in BACK_EDGE_OP_TYPES:  # (its data and control inputs close the loop)
            return []
        found = [t.op for t in op.inputs] + list(op.control_inputs)
        return [p for p in _unique_ops(found) if p in members]

    remaining = dict.fromkeys(ops)
    # Peel ops with no producer left (sources), then ops with no consumer left (sinks):
    # what stays lies on a cycle or between two.
    for incoming in (producers, _consumers_within(members, producers)):
        counts = {op: len(incoming(op)) for op in remaining}
        ready = collections.deque(op for op in remaining if counts[op] == 0)
        outgoing = collections.defaultdict(list)
        for op in remaining:
            for p in incoming(op):
                if p in remaining:
                    outgoing[p].append(op)
        while ready:
            op = ready.popleft()
            del remaining[op]
            for c in outgoing[op]:
                counts[c] -= 1
                if counts[c] == 0 and c in remaining:
                    ready.append(c)
    return list(remaining)


def _consumers_within(members, producers):
    """`consumers(op)`: the ops of `members` for which `op` is one of `producers(c)`."""
    consumers = collections.defaultdict(list)
    for op in members:
        for p in producers(op):
            consumers[p].append(op)
    return lambda op: consumers[op]


def filter_ops(ops, positive_filter):
    """Ops of `ops` (or of a graph) for which `positive_filter(op)` is true.

    Args:
      ops: ops, tensors or a graph.
      positive_filter: a predicate on ops, or True to keep everything.
    Returns:
      A list of ops, in the order of `ops`.
    """
    ops = make_list_of_op(ops)
    if positive_filter is True:
        return ops
    return [op for op in ops if positive_filter(op)]


def filter_ts(ops, positive_filter):
    """Output tensors of `ops` (or of a graph) for which `positive_filter(t)` is true.

    Args:
      ops: ops, tensors standing for their producers, or a graph.
      positive_filter: a predicate on tensors, or True to keep everything.
    Returns:
      A list of tensors, op by op in the order of `ops`.
    """
    ts = [t for op in make_list_of_op(ops) for t in op.outputs]
    if positive_filter is True:
        return ts
    return [t for t in ts if positive_filter(t)]


def filter_ops_from_regex(ops, regex):
    """Ops whose full name matches `regex` (re.search, so anchor it with ^...$ to match whole names).

    Args:
      ops: ops, tensors or a graph.
      regex: a pattern string or compiled pattern.
    Returns:
      A list of ops.
    """
    pattern = re.compile(regex)
    return filter_ops(ops, lambda op: pattern.search(op.name) is not None)


def filter_ts_from_regex(ops, regex):
    """Output tensors whose full name (`op_name:index`) matches `regex` (re.search).

    Args:
      ops: ops, tensors standing for their producers, or a graph.
      regex: a pattern string or compiled pattern.
    Returns:
      A list of tensors.
    """
    pattern = re.compile(regex)
    return filter_ts(ops, lambda t: pattern.search(t.name) is not None)


def filter_ops_by_type(ops, op_types):
    """Ops whose `op.type` is one of `op_types`.

    Args:
      ops: ops, tensors or a graph.
      op_types: an op type name or a list of them, e.g. ["MatMul", "Conv2D"].
    Returns:
      A list of ops.
    """
    wanted = frozenset(_as_list(op_types))
    return filter_ops(ops, lambda op: op.type in wanted)


def get_name_scope_ops(ops, scope):
    """Ops under name scope `scope`: named `scope` itself or `scope/...`.

    Args:
      ops: ops, tensors or a graph.
      scope: a name scope, with or without the trailing "/" ("foo/bar" does not
        take "foo/barn/x").
    Returns:
      A list of ops.
    """
    scope = scope.rstrip("/")
    return filter_ops(ops, lambda op: op.name == scope or op.name.startswith(scope + "/"))
