"""The candidates for checkpoints: cuts of the region's topological order.

The tensors crossing a cut (made at or before it, read after it) split the forward
pass in two. Only tensors that depend on the data count: tensors computed from the
parameters alone (a batch-norm scale reshaped, a bias squeezed) are tiny and are
recomputed by the one segment that reads them, so they never make a cut expensive.
The searches (memsave.planner.search) and the 'memory' strategy's narrowest cuts
(memsave.strategies.memory) choose among them.
"""

import numpy as np

from memsave.planner.graph import REGION, RESIDENT, is_data
from memsave.planner.segments import widening_cast_input

_GRID = 16  # how many segment budgets segment_sizes proposes


class Candidates:
    """The region's cuts and the data-dependent tensors crossing them."""

    def __init__(self, graph):
        self.graph = graph
        self.region_ops = graph.region_op_ids()
        self.position = {op: i for i, op in enumerate(self.region_ops)}
        spans = self._spans(graph)
        n = len(self.region_ops)
        self.n_cuts = max(n - 1, 0)
        produced = np.zeros(max(n, 1), dtype=np.int64)
        for tid, (start, _) in spans.items():
            produced[start] += graph.size[tid]
        self.produced = produced
        # (A widening Cast's output is made again from its narrower input wherever a
        # cut after the Cast would keep it: the input stays, at a fraction of the bytes.
        # `produced` still counts the output: a segment holding the Cast makes it.)
        moved = {}
        for cast_output, source in list(self._widening_casts(graph, spans)):
            while source in moved:  # (a Cast of a Cast: to the narrowest)
                source = moved[source]
            start, stop = spans.pop(cast_output)
            spans[source] = (spans[source][0], max(spans[source][1], stop))
            moved[cast_output] = source
        self.intervals = sorted(((tid, start, stop) for tid, (start, stop) in spans.items()),
                                key=lambda interval: (interval[1], interval[0]))
        self.tensors = [tid for tid, _, _ in self.intervals]
        self._starts = np.array([start for _, start, _ in self.intervals], dtype=np.int64)
        self._stops = np.array([stop for _, _, stop in self.intervals], dtype=np.int64)
        diff = np.zeros(self.n_cuts + 1, dtype=np.int64)
        for tid, start, stop in self.intervals:
            diff[start] += graph.size[tid]
            diff[min(stop, self.n_cuts)] -= graph.size[tid]
        self.crossing = np.cumsum(diff)[:self.n_cuts]

    def _spans(self, graph):
        """{tensor id: (its producer's position, its last forward reader's)} for the
        data-dependent region tensors read after the op that makes them."""
        data = _data_dependent(graph)
        spans = {}
        for op in self.region_ops:
            start = self.position[op]
            for tid in graph.outputs[op]:
                if not data[tid] or graph.is_y[tid] or graph.size[tid] == 0:
                    continue
                stop = max((self.position[c] for c in graph.consumers[tid]
                            if graph.kind[c] == REGION), default=start)
                if stop > start:
                    spans[tid] = (start, stop)
        return spans

    def _widening_casts(self, graph, spans):
        """(output, input) of the region's Casts to a wider type whose input may be kept
        (segments.widening_cast_input), producers first.

        Keeping the output would hold twice the bytes (bfloat16 to float32) for one
        cheap elementwise op saved: a plan that keeps it holds its input instead
        (segments.narrowed_checkpoints), which the cuts then count.
        """
        for op in self.region_ops:
            source = widening_cast_input(graph, op)
            if source is not None and source in spans and graph.outputs[op][0] in spans:
                yield graph.outputs[op][0], source

    def tensors_crossing(self, cuts):
        """Tensor ids crossing any of `cuts` (sorted), in topological order."""
        if not cuts:
            return []
        cuts = np.asarray(cuts)
        # For each interval, the first cut at or after its start; it crosses one if that
        # cut comes before its stop.
        index = np.searchsorted(cuts, self._starts)
        found = index < len(cuts)
        found[found] = cuts[index[found]] < self._stops[found]
        return [self.intervals[i][0] for i in np.flatnonzero(found)]

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
               and op not in graph.constants for t in graph.outputs[op]
               if is_data(graph.tensors[t])]
    sources += [t for t, is_x in enumerate(graph.is_x) if is_x and is_data(graph.tensors[t])]
    for t in sources:
        data[t] = True
    for op in range(len(graph.ops)):
        if any(data[t] for t in graph.inputs[op]):
            for t in graph.outputs[op]:
                data[t] = True
    if not any(data[t] for op in graph.region_op_ids() for t in graph.outputs[op]):
        return [True] * len(graph.tensors)
    return data
