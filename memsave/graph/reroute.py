"""Rerouting: pointing consumers of tensors at other tensors, in place."""

from memsave.graph import _tf_private
from memsave.graph.select import make_list_of_op, make_list_of_t


def _check_compatible(t_new, t_old):
    if t_new.dtype.base_dtype != t_old.dtype.base_dtype:
        raise ValueError(f"memsave.graph: cannot reroute {t_old.name} ({t_old.dtype.name}) "
                         f"onto {t_new.name} ({t_new.dtype.name}): dtypes differ")
    if not t_new.shape.is_compatible_with(t_old.shape):
        raise ValueError(f"memsave.graph: cannot reroute {t_old.name} {t_old.shape} "
                         f"onto {t_new.name} {t_new.shape}: shapes are incompatible")


def _reroute_edges(pairs, can_modify, cannot_modify):
    """The one reroute engine: for each (new, old), consumers of old read new.

    Every pair is checked before any edge moves, so a failure changes nothing.
    Returns the number of edges moved.
    """
    allowed = None if can_modify is None else set(make_list_of_op(can_modify))
    forbidden = set() if cannot_modify is None else set(make_list_of_op(cannot_modify))
    for t_new, t_old in pairs:
        _check_compatible(t_new, t_old)
    edges = []
    for t_new, t_old in pairs:
        for consumer in t_old.consumers():
            if consumer in forbidden or (allowed is not None and consumer not in allowed):
                continue
            for index, t in enumerate(consumer.inputs):
                if t is t_old:
                    edges.append((consumer, index, t_new))
    # Apply after collecting: moving an edge changes consumers() lists mid-walk.
    for consumer, index, t_new in edges:
        _tf_private.update_input(consumer, index, t_new)
    return len(edges)


def _pairs(ts0, ts1):
    ts0, ts1 = make_list_of_t(ts0), make_list_of_t(ts1)
    if len(ts0) != len(ts1):
        raise ValueError(f"memsave.graph: got {len(ts0)} and {len(ts1)} tensors; "
                         "reroute needs lists of the same length")
    return list(zip(ts0, ts1))


def reroute_ts(ts0, ts1, can_modify=None, cannot_modify=None):
    """Makes the consumers of each `ts1[i]` read `ts0[i]` instead.

    Args:
      ts0: the tensors to read from now.
      ts1: the tensors whose consumers are rerouted.
      can_modify: if given, only these ops are modified.
      cannot_modify: ops never modified.
    Returns:
      The number of edges changed.
    Raises:
      ValueError: if lengths, dtypes or shapes do not match (nothing is changed).
    """
    return _reroute_edges(_pairs(ts0, ts1), can_modify, cannot_modify)


def swap_ts(ts0, ts1, can_modify=None, cannot_modify=None):
    """Swaps consumers: readers of `ts0[i]` read `ts1[i]` and vice versa.

    Returns:
      The number of edges changed.
    Raises:
      ValueError: as `reroute_ts`, before anything changes.
    """
    pairs = _pairs(ts0, ts1)
    for t0, t1 in pairs:
        _check_compatible(t0, t1)
    allowed = None if can_modify is None else set(make_list_of_op(can_modify))
    forbidden = set() if cannot_modify is None else set(make_list_of_op(cannot_modify))
    # Freeze who reads what before moving anything, then move both directions.
    readers = [(list(t0.consumers()), list(t1.consumers())) for t0, t1 in pairs]
    moved = 0
    for (t0, t1), (readers0, readers1) in zip(pairs, readers):
        moved += _reroute_edges([(t1, t0)], _restrict(readers0, allowed), forbidden)
        moved += _reroute_edges([(t0, t1)], _restrict(readers1, allowed), forbidden)
    return moved


def _restrict(ops, allowed):
    return [op for op in ops if allowed is None or op in allowed]
