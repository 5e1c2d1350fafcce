"""A budget's local search: from the best of some plans, one checkpoint added, dropped or
moved at a time while that recomputes less within the limit (memsave.planner.search runs
it on regions of up to LOCAL_SEARCH_LIMIT candidates, where the greedy cuts alone
recomputed up to twice what the least costly fitting plan does). Standing on a plan that
fits, a round simulates its neighbours cheapest first until one fits
(`_cheapest_fitting`), not all of them.
"""

LOCAL_SEARCH_ROUNDS = 16


def improved(search, plans, limit_bytes):
    """A local search from the best of `plans` (the cut plans, which on a small region
    can recompute twice what the least costly plan does, or all miss a limit that
    some plan meets, and the one-checkpoint plans): each round moves to the best
    neighbour (one candidate added, one dropped, or one moved to a candidate up to two
    places away in topological order; where none is better, one added while another
    moves) until none is better. A plan that fits (its live tensors) is better than
    one that does not; among fitting plans less cost is better, among the others a
    lower peak (with every movable checkpoint offloaded, where offload is allowed).
    Returns (Prediction, plan, offloaded) of the end point if it fits, else None."""
    tensors = search.candidates.tensors
    position = {t: i for i, t in enumerate(tensors)}
    producer = search.model.graph.producer

    def ordered(ids):  # (a plan may hold expensive outputs that are no candidates)
        return sorted(ids, key=lambda t: (producer[t], t))

    def scored(plan):
        fitted = search.fit(plan, limit_bytes, allocator=False)
        if fitted is not None:
            return (0, fitted[0].cost_flops, fitted[0].peak_bytes), fitted
        prediction = search.predict(plan, search.movable(plan))
        return (1, prediction.peak_bytes, prediction.cost_flops), None

    def moved(kept):
        for t in ordered(kept):
            for step in (-2, -1, 1, 2) if t in position else ():
                i = position[t] + step
                if 0 <= i < len(tensors) and tensors[i] not in kept:
                    yield kept - {t} | {tensors[i]}

    def neighbours(plan):
        kept = set(plan)
        for t in tensors:
            yield ordered(kept ^ {t})
        for other in moved(kept):
            yield ordered(other)

    def added_and_moved(plan):
        kept, seen = set(plan), set()
        for t in tensors:
            if t not in kept:
                for other in moved(kept):
                    candidate = tuple(ordered(other | {t}))
                    if t not in other and candidate not in seen:
                        seen.add(candidate)
                        yield list(candidate)

    def best_of(plans, bound=None):  # (plans costing more than a fitting bound: not simulated)
        if bound is not None and bound[0] == 0 and search.offloadable is None:
            return _cheapest_fitting(search, plans, bound, limit_bytes)
        return min((scored(p) + (p,) for p in plans if p), key=lambda f: f[0], default=None)

    starts = [ordered(set(plan)) for plan in plans if plan]
    if not starts:
        return None
    score, fitted, plan = best_of(starts)
    for _ in range(LOCAL_SEARCH_ROUNDS):
        best = best_of(neighbours(plan), score)
        if best is None or best[0] >= score:
            # Stuck: a checkpoint more where another moves (one more segment, its
            # boundaries shifted) may fit where neither step alone does.
            best = best_of(added_and_moved(plan), score)
        if best is None or best[0] >= score:
            break
        score, fitted, plan = best
    return fitted


def _cheapest_fitting(search, plans, bound, limit_bytes):
    """The best of `plans` as `improved` scores them, where the plan they are
    neighbours of fits (its score `bound`): only a fitting plan that costs no more can
    be better, and among those the least costly is (then the lowest peak). So they are
    ranked by cost (MemoryModel.cost_of: no simulation) and simulated cheapest first
    until one fits, with the others of its cost: the same answer as simulating every
    one (keras-hub GPT-2's budget(0.5): about a third of a round's simulations).
    Returns (score, fitted, plan) of the best that fits at no more than the bound's cost
    (which may score no better than the bound: the caller compares), or None where none
    does."""
    # (a stable sort: among equals the first made wins, as `min` lets it)
    costed = sorted(((cost, plan) for cost, plan in ((search.cost(p), p) for p in plans if p)
                     if cost <= bound[1]), key=lambda c: c[0])
    best = None
    for cost, plan in costed:
        if best is not None and cost > best[0][1]:
            break
        fitted = search.fit(plan, limit_bytes, allocator=False)
        if fitted is not None:
            found = ((0, fitted[0].cost_flops, fitted[0].peak_bytes), fitted, plan)
            best = found if best is None or found[0] < best[0] else best
    return best
