"""'memory': automatic checkpoints at the narrowest cuts, about sqrt(N) of them.

In the region's topological order, cut i lies between op i and op i+1. The
tensors *crossing* a cut (made at or before it, read after it) are a complete
boundary: checkpointing them splits the forward pass in two. On a plain chain
each cut is crossed by one tensor, a single-tensor separator ("bottleneck");
skip connections (ResNet, DenseNet, U-Net, transformer residuals) make some or
all cuts be crossed by several tensors, and the strategy then takes the cut that
is cheapest to keep instead of giving up.

Crossing sizes for all cuts come from one difference-array pass over the
region's edges, so choosing is linear in graph size.
"""

import bisect
import math

import numpy as np

from memsave.region import estimated_bytes
from memsave.strategies.base import Choice


def _live_intervals(region):
    """For each region tensor read inside the region: (tensor, first cut, last cut + 1, bytes)."""
    end = len(region.ops)
    intervals = []
    for op in region.ops:
        start = region.position[op]
        for t in op.outputs:
            readers = [region.position[c] for c in region.region_consumers(t)]
            stop = end if region.is_y(t) else max(readers, default=start)
            if stop > start:
                intervals.append((t, start, stop, estimated_bytes(t)))
    return intervals


def _crossing_bytes(intervals, n_cuts):
    """Bytes crossing each cut, via a difference array."""
    diff = np.zeros(n_cuts + 1, dtype=np.int64)
    for _, start, stop, size in intervals:
        diff[start] += size
        diff[min(stop, n_cuts)] -= size
    return np.cumsum(diff)[:n_cuts]


def _choose_cuts(crossing, produced, count):
    """Picks `count` cuts spread evenly over the activation bytes, each the
    cheapest within its window (ties go to the cut nearest the window's target)."""
    n_cuts = len(crossing)
    cumulative = np.cumsum(produced)[:n_cuts]
    total = float(cumulative[-1]) if n_cuts else 0.0
    if total <= 0:
        cumulative, total = np.arange(1, n_cuts + 1, dtype=np.float64), float(n_cuts)
    targets = [int(np.searchsorted(cumulative, total * j / (count + 1))) for j in range(1, count + 1)]
    half_window = max(1, n_cuts // (2 * (count + 1)))
    chosen = []
    for target in targets:
        low = max(target - half_window, chosen[-1] + 1 if chosen else 0)
        high = min(target + half_window, n_cuts - 1)
        if low > high:
            continue
        window = np.arange(low, high + 1)
        cost = crossing[window].astype(np.float64)
        best = window[np.lexsort((np.abs(window - target), cost))[0]]
        chosen.append(int(best))
    return chosen


def narrowest_cuts(count=None):
    """A strategy keeping the tensors crossing ~sqrt(N) cheap, evenly spaced cuts.

    Args:
      count: how many cuts; default round(sqrt(number of region ops)).
    Returns:
      A strategy.
    """
    def strategy(region):
        n_cuts = len(region.ops) - 1
        if n_cuts < 1:
            return []
        intervals = _live_intervals(region)
        crossing = _crossing_bytes(intervals, n_cuts)
        produced = np.zeros(len(region.ops), dtype=np.int64)
        for _, start, _, size in intervals:
            produced[start] += size
        wanted = count or max(1, int(round(math.sqrt(len(region.ops)))))
        cuts = _choose_cuts(crossing, produced, min(wanted, n_cuts))
        return _tensors_crossing(intervals, cuts)
    strategy.__name__ = "narrowest_cuts"
    return strategy


def _tensors_crossing(intervals, cuts):
    """Tensors crossing any of the sorted `cuts`, each once, in topological order."""
    crossing_count = {cut: 0 for cut in cuts}
    hits = []
    for t, start, stop, _ in intervals:
        index = bisect.bisect_left(cuts, start)
        if index < len(cuts) and cuts[index] < stop:
            hits.append((t, index))
            for cut in cuts[index:bisect.bisect_left(cuts, stop)]:
                crossing_count[cut] += 1
    choices = []
    for t, index in hits:
        cut = cuts[index]
        kind = "single-tensor separator" if crossing_count[cut] == 1 else \
            f"one of {crossing_count[cut]} tensors crossing"
        choices.append(Choice(t, f"{kind} at cut {index + 1} of {len(cuts)} (after region op {cut})"))
    return choices
