"""Choosing checkpoints with the memory model.

Candidates are cuts of the region's topological order: the tensors crossing a
cut (made at or before it, read after it) split the forward pass in two. Only
tensors that depend on the data count: tensors computed from the parameters
alone (a batch-norm scale reshaped, a bias squeezed) are tiny and are recomputed
by the one segment that reads them, so they never make a cut expensive.

- `minimise_peak`: plans built greedily for a range of segment sizes (Chen et
  al. 2016, section 4.3: cut when a segment's activations pass a budget, here at
  the cheapest cut in reach), each simulated; the lowest predicted peak wins,
  ties going to less recomputation.
- `within_budget`: the least recomputation whose predicted peak fits a limit:
  those plans, each also with the outputs of expensive ops kept while they fit.

On small regions the searches try every subset of the candidate tensors, so small
graphs get the optimum of the model: up to EXACT_PEAK_LIMIT candidates for the
lowest peak (which runs on every 'memory' call), up to EXACT_BUDGET_LIMIT for a
budget (one model evaluation per subset: 2**14 of them take about a second).
"""

import itertools

import numpy as np

from memsave.planner.graph import REGION, RESIDENT

EXACT_PEAK_LIMIT = 10
EXACT_BUDGET_LIMIT = 14
_GRID = 24


class Candidates:
    """The region's cuts and the data-dependent tensors crossing them."""

    def __init__(self, graph):
        self.graph = graph
        self.region_ops = graph.region_op_ids()
        self.position = {op: i for i, op in enumerate(self.region_ops)}
        data = _data_dependent(graph)
        self.intervals = []       # (tensor id, first cut, last cut + 1)
        self.tensors = []         # data-dependent region tensors that may be kept
        n = len(self.region_ops)
        for op in self.region_ops:
            start = self.position[op]
            for tid in graph.outputs[op]:
                if not data[tid] or graph.is_y[tid] or graph.size[tid] == 0:
                    continue
                readers = [self.position[c] for c in graph.consumers[tid]
                           if graph.kind[c] == REGION]
                stop = max(readers, default=start)
                if stop > start:
                    self.intervals.append((tid, start, stop))
                    self.tensors.append(tid)
        self.n_cuts = max(n - 1, 0)
        diff = np.zeros(self.n_cuts + 1, dtype=np.int64)
        produced = np.zeros(max(n, 1), dtype=np.int64)
        for tid, start, stop in self.intervals:
            size = graph.size[tid]
            diff[start] += size
            diff[min(stop, self.n_cuts)] -= size
            produced[start] += size
        self.crossing = np.cumsum(diff)[:self.n_cuts]
        self.produced = produced

    def tensors_crossing(self, cuts):
        """Tensor ids crossing any of `cuts` (sorted), in topological order."""
        if not cuts:
            return []
        cuts = np.asarray(cuts)
        result = []
        for tid, start, stop in self.intervals:
            index = np.searchsorted(cuts, start)
            if index < len(cuts) and cuts[index] < stop:
                result.append(tid)
        return result

    def greedy_cuts(self, segment_bytes):
        """Cuts made whenever a segment's activations would pass `segment_bytes`,
        each at the cheapest cut since the previous one (the latest among equals)."""
        chosen, last, acc = [], -1, 0
        produced, crossing = self.produced, self.crossing
        for k in range(self.n_cuts):
            acc += int(produced[k])
            if acc <= segment_bytes:
                continue
            window = crossing[last + 1:k + 1]
            best = last + 1 + int(len(window) - 1 - np.argmin(window[::-1]))
            chosen.append(best)
            acc = int(produced[best + 1:k + 1].sum())
            last = best
        return chosen

    def segment_sizes(self):
        """A geometric range of segment budgets, from one op's output to the whole region."""
        total = int(self.produced.sum())
        smallest = max(int(self.produced.max(initial=0)), 1)
        if total <= smallest:
            return [smallest]
        return sorted(set(int(v) for v in np.geomspace(smallest, total, _GRID)))


def _data_dependent(graph):
    """Per tensor: whether it depends on data (inputs that are not constants or variables).

    The non-variable xs count as data too; when nothing depends on data (every
    input a constant or a variable), every tensor counts.
    """
    data = [False] * len(graph.tensors)
    sources = [t for op, kind in enumerate(graph.kind) if kind == RESIDENT
               and graph.ops[op].type != "Const" for t in graph.outputs[op]
               if _is_data(graph.tensors[t])]
    sources += [t for t, is_x in enumerate(graph.is_x) if is_x and _is_data(graph.tensors[t])]
    for t in sources:
        data[t] = True
    for op in range(len(graph.ops)):
        if any(data[t] for t in graph.inputs[op]):
            for t in graph.outputs[op]:
                data[t] = True
    if not any(data[t] for op in graph.region_op_ids() for t in graph.outputs[op]):
        return [True] * len(graph.tensors)
    return data


def _is_data(t):
    import tensorflow as tf
    return t.dtype not in (tf.resource, tf.variant) and t.dtype != tf.string


def _better_for_peak(a, b):
    return b is None or (a[0].peak_bytes, a[0].recompute_flops) < (b[0].peak_bytes,
                                                                     b[0].recompute_flops)


def _better_for_cost(a, b):
    return b is None or (a[0].recompute_flops, a[0].peak_bytes) < (b[0].recompute_flops,
                                                                     b[0].peak_bytes)


def _subsets(tensors):
    for r in range(len(tensors) + 1):
        for subset in itertools.combinations(tensors, r):
            yield list(subset)


def cut_plans(model, candidates):
    """The greedy plans for every segment budget (distinct checkpoint lists)."""
    seen, plans = set(), []
    for size in candidates.segment_sizes():
        plan = candidates.tensors_crossing(candidates.greedy_cuts(size))
        key = tuple(plan)
        if plan and key not in seen:
            seen.add(key)
            plans.append(plan)
    return plans


def minimise_peak(model, extra_plans=(), exact=None):
    """(Prediction, checkpoint tensor ids) of the plan with the lowest predicted peak.

    Args:
      model: the MemoryModel.
      extra_plans: more checkpoint lists to consider.
      exact: try every subset (default: when there are few candidates).
    """
    candidates = Candidates(model.graph)
    if exact is None:
        exact = len(candidates.tensors) <= EXACT_PEAK_LIMIT
    if exact:
        plans = _subsets(candidates.tensors)
    else:
        plans = itertools.chain(cut_plans(model, candidates), extra_plans)
    best = None
    for plan in plans:
        if not plan:
            continue
        found = (model.predict(plan), plan)
        if _better_for_peak(found, best):
            best = found
    return best


def within_budget(model, limit_bytes, expensive, exact=None):
    """(Prediction, checkpoint ids) of the least recomputation with peak <= limit_bytes,
    or None when no plan fits.

    Args:
      model: the MemoryModel.
      limit_bytes: the budget.
      expensive: tensor ids worth keeping to save recomputation (outputs of
        matmuls and convolutions), in topological order.
      exact: try every subset (default: when there are few candidates).
    """
    candidates = Candidates(model.graph)
    if exact is None:
        exact = len(candidates.tensors) <= EXACT_BUDGET_LIMIT
    if exact:
        plans = _subsets(candidates.tensors)
    else:
        plans = _budget_plans(model, candidates, expensive, limit_bytes)
    best = None
    for plan in plans:
        if not plan:
            continue
        found = (model.predict(plan), plan)
        if found[0].peak_bytes <= limit_bytes and _better_for_cost(found, best):
            best = found
    return best


def _budget_plans(model, candidates, expensive, limit_bytes):
    """Cut plans, and each with as many expensive outputs kept as still fit."""
    expensive = [t for t in expensive if model.graph.size[t] > 0]
    for plan in cut_plans(model, candidates):
        yield plan
        if not expensive:
            continue
        # Expensive outputs by cost saved per byte kept, best first.
        graph = model.graph
        ranked = sorted(expensive, key=lambda t: -graph.cost[graph.producer[t]] / graph.size[t])
        kept = list(plan)
        chosen = set(plan)
        low, high = 0, len(ranked)
        # Binary search for the longest prefix of `ranked` that still fits.
        while low < high:
            middle = (low + high + 1) // 2
            trial = kept + [t for t in ranked[:middle] if t not in chosen]
            if model.predict(trial).peak_bytes <= limit_bytes:
                low = middle
            else:
                high = middle - 1
        if low:
            yield kept + [t for t in ranked[:low] if t not in chosen]
