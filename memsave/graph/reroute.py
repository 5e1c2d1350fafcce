"""Rerouting: pointing consumers of tensors at other tensors, in place.

Every function here checks everything first (lengths, dtypes, shapes, cycles)
and only then moves edges, so a failure leaves the graph exactly as it was.
All the edges of one call are decided on the graph as it was before the call,
then moved together: `swap_ts([a], [b])` on `c = a + b` gives `c = b + a`.
"""

from memsave.graph import _tf_private
from memsave.graph.select import (
    get_forward_walk_ops, make_list_of_t, make_op_membership, tensor_key)


def _check_compatible(t_new, t_old):
    if t_new.graph is not t_old.graph:
        raise ValueError(f"memsave.graph: cannot reroute {t_old.name} onto {t_new.name}: "
                         "they live in different graphs")
    if t_new.dtype.base_dtype != t_old.dtype.base_dtype:
        raise ValueError(f"memsave.graph: cannot reroute {t_old.name} ({t_old.dtype.name}) "
                         f"onto {t_new.name} ({t_new.dtype.name}): dtypes differ")
    if not t_new.shape.is_compatible_with(t_old.shape):
        raise ValueError(f"memsave.graph: cannot reroute {t_old.name} {t_old.shape} "
                         f"onto {t_new.name} {t_new.shape}: shapes are incompatible")


def _collect_edges(pairs, allowed, forbidden):
    """The edges `(consumer, input_index, t_new)` that rerouting `pairs` moves."""
    edges = []
    for t_new, t_old in pairs:
        old_key = tensor_key(t_old)
        # consumers() lists an op once per input it reads t_old on; visit it once.
        for consumer in dict.fromkeys(t_old.consumers()):
            if consumer in forbidden or (allowed is not None and consumer not in allowed):
                continue
            for index, t in enumerate(consumer.inputs):
                if tensor_key(t) == old_key:
                    edges.append((consumer, index, t_new))
    return edges


def _check_no_cycle(edges):
    """Raises ValueError if an edge would make an op read (indirectly) its own output.

    That happens when a consumer of the old tensor is an ancestor of the new one,
    e.g. `reroute_ts([tf.stop_gradient(x)], [x])` without excluding the
    stop_gradient op itself.
    """
    if not edges:
        return
    consumers = list(dict.fromkeys(consumer for consumer, _, _ in edges))
    downstream = set(get_forward_walk_ops(consumers, control_outputs=True))
    if not any(t_new.op in downstream for _, _, t_new in edges):
        return
    for consumer, index, t_new in edges:
        if t_new.op in set(get_forward_walk_ops([consumer], control_outputs=True)):
            raise ValueError(
                f"memsave.graph: rerouting input {index} of {consumer.name} onto {t_new.name} "
                f"would make a cycle ({t_new.name} depends on {consumer.name}); leave "
                f"{consumer.name} out with cannot_modify=[...] or restrict can_modify")


def _reroute_edges(pairs, can_modify, cannot_modify):
    """The one reroute engine: for each `(new, old)`, consumers of old read new.

    Returns:
      The number of edges moved.
    Raises:
      ValueError: before anything changes, on incompatible pairs or a cycle.
    """
    allowed = None if can_modify is None else make_op_membership(can_modify)
    forbidden = make_op_membership(cannot_modify) if cannot_modify is not None else set()
    for t_new, t_old in pairs:
        _check_compatible(t_new, t_old)
    edges = _collect_edges(pairs, allowed, forbidden)
    _check_no_cycle(edges)
    # Apply after collecting: moving an edge changes consumers() lists mid-walk.
    for consumer, index, t_new in edges:
        _tf_private.update_input(consumer, index, t_new)
    return len(edges)


def _pairs(ts0, ts1):
    ts0 = make_list_of_t(ts0, allow_duplicates=True)
    ts1 = make_list_of_t(ts1, allow_duplicates=True)
    if len(ts0) != len(ts1):
        raise ValueError(f"memsave.graph: got {len(ts0)} and {len(ts1)} tensors; "
                         "reroute needs lists of the same length")
    seen = {}
    for t in ts1:
        if tensor_key(t) in seen:
            raise ValueError(f"memsave.graph: {t.name} is rerouted twice; each tensor whose "
                             "consumers move may appear once")
        seen[tensor_key(t)] = None
    return list(zip(ts0, ts1))


def reroute_ts(ts0, ts1, can_modify=None, cannot_modify=None):
    """Makes the consumers of each `ts1[i]` read `ts0[i]` instead.

    Args:
      ts0: the tensors to read from now (a tensor or a list of tensors).
      ts1: the tensors whose consumers are rerouted, as many as `ts0`.
      can_modify: if given, only these ops are modified (ops or tensors standing
        for their producers; any iterable).
      cannot_modify: ops never modified.
    Returns:
      The number of edges (op inputs) changed.
    Raises:
      ValueError: if the lengths, graphs, dtypes or shapes do not match, if a
        tensor appears twice in `ts1`, or if an edge would create a cycle. Nothing
        is changed then.
    """
    return _reroute_edges(_pairs(ts0, ts1), can_modify, cannot_modify)


def swap_ts(ts0, ts1, can_modify=None, cannot_modify=None):
    """Swaps consumers: readers of `ts0[i]` read `ts1[i]` and readers of `ts1[i]` read `ts0[i]`.

    Args:
      ts0, ts1: lists of tensors of the same length.
      can_modify: if given, only these ops are modified.
      cannot_modify: ops never modified.
    Returns:
      The number of edges changed.
    Raises:
      ValueError: as `reroute_ts`, before anything changes.
    """
    pairs = _pairs(ts0, ts1)
    both_ways = [(t1, t0) for t0, t1 in pairs] + pairs
    _pairs([t for t, _ in both_ways], [t for _, t in both_ways])
    return _reroute_edges(both_ways, can_modify, cannot_modify)
