"""narrowest_cuts: a fixed number of cheap, evenly spaced cuts (memsave's 'memory'
before the planner; kept as a building block for custom strategies).

In the region's topological order, cut i lies between op i and op i+1. The
tensors *crossing* a cut (made at or before it, read after it) are a complete
boundary: checkpointing them splits the forward pass in two. On a plain chain
each cut is crossed by one tensor, a single-tensor separator ("bottleneck");
skip connections make some or all cuts be crossed by several tensors, and the
strategy then takes the cut that is cheapest to keep instead of giving up. The
cuts and their crossing bytes come from the planner (memsave.planner.search),
which also leaves out tensors computed from the parameters alone.
"""

import math

import numpy as np

from memsave.planner.candidates import Candidates
from memsave.strategies.base import Choice


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
    """A strategy keeping the tensors crossing `count` cheap, evenly spaced cuts.

    Args:
      count: how many cuts; default round(sqrt(number of region ops)).
    Returns:
      A strategy.
    """
    def strategy(region):
        graph = region.model.graph
        candidates = Candidates(graph)
        if candidates.n_cuts < 1:
            return []
        wanted = count or max(1, int(round(math.sqrt(len(region.ops)))))
        cuts = _choose_cuts(candidates.crossing, candidates.produced,
                            min(wanted, candidates.n_cuts))
        crossing = {cut: candidates.tensors_crossing([cut]) for cut in cuts}
        choices, seen = [], set()
        for index, cut in enumerate(cuts):
            kind = ("single-tensor separator" if len(crossing[cut]) == 1 else
                    f"one of {len(crossing[cut])} tensors crossing")
            for tid in crossing[cut]:
                if tid not in seen:
                    seen.add(tid)
                    choices.append(Choice(graph.tensors[tid], f"{kind} at cut {index + 1} of "
                                                              f"{len(cuts)}"))
        return choices
    strategy.__name__ = "narrowest_cuts"
    return strategy
