"""Choosing checkpoints with the memory model.

Candidates are cuts of the region's topological order (memsave.planner.candidates):
the tensors crossing a cut split the forward pass in two.

- `minimise_peak`: plans built greedily for a range of segment sizes (Chen et
  al. 2016, section 4.3: cut when a segment's activations pass a budget, here at
  the cheapest cut in reach), each simulated; the lowest predicted peak wins, ties
  going to less recomputation; for 'memory', of the plans within NEAR_LOWEST of it
  recomputing no more, the one with the smallest segments (least recomputation per
  segment: what the model leaves out grows with a segment), then with the outputs of
  expensive ops kept while both its peaks (live, held) stay within a tolerance.
- `within_budget`: the least recomputation whose predicted peak fits a limit:
  those plans, each also with the outputs of expensive ops kept while they fit (as
  they are, and at the ends of the cheap ops they flow through alone:
  memsave.planner.expensive).
  A plan fits when the chunks the device's allocator would hold for it do
  (MemoryModel.predict(..., allocator=True)), where the model simulates one: a
  plan filled up to the limit by its live tensors alone would overrun it. The
  allocator never holds less than the tensors, so each search runs on live
  tensors first and replays only near its answer (a replay costs about as much
  as the simulation it replays).
  Where host offload is allowed (`Offloadable`), a plan that does not fit may
  still fit with some of its checkpoints offloaded (earliest first: they wait
  longest for their backward), and its cost is then recomputation plus transfers.

On regions of up to LOCAL_SEARCH_LIMIT candidates, a budget's search goes on from the
best of the cut plans and the one-checkpoint plans by local moves (a checkpoint added,
dropped or moved to a neighbour: memsave.planner.local_search): there the greedy cuts
alone recomputed up to twice what the least costly fitting plan does.

On small regions the searches try every subset of the candidate tensors, so small
graphs get the optimum of the model: up to EXACT_PEAK_LIMIT candidates for the
lowest peak (which runs on every 'memory' call), up to EXACT_BUDGET_LIMIT for a
budget, and up to EXACT_OFFLOAD_LIMIT for a budget that may offload (each candidate
dropped, kept or offloaded: 3**n plans; 2**10 subsets take a quarter of a second on a
region of a few dozen ops, AMD EPYC, 2026-11-25).
"""

import dataclasses
import itertools

from memsave.planner import costs
from memsave.planner.candidates import Candidates
from memsave.planner.expensive import outside_last_segment, rankings
from memsave.planner.local_search import improved

EXACT_PEAK_LIMIT = 10
PEAK_TIE = 0.005
# 'memory' takes, of the cut plans within this share of the lowest peak that recompute no
# more than the plan the lowest peak alone picks (PEAK_TIE), the one whose segments
# recompute least each (its recomputation over its segments).
# What the model leaves out grows with a segment: gradient work TensorFlow starts as soon
# as a segment's copies exist (GELU's pow(x, 2)), and chunks the allocator leaves unsplit.
# keras-hub GPT-2 under fit (Adam, batch 8): 4 checkpoints predicted 1.3% below 6, measured
# 254.5 MiB against 211.0; ViT: 15 checkpoints predicted 1.1% above 40 (and 2.9% below as
# the allocator replay holds them), measured 80.2 against 78.4 (Intel Xeon).
NEAR_LOWEST = 0.015
EXACT_BUDGET_LIMIT = 10
EXACT_OFFLOAD_LIMIT = 8
LOCAL_SEARCH_LIMIT = 32
# A time budget bisects between the lowest peak found and the best peak found within its
# time until the two are this close (a share of the upper), in at most REFINEMENTS budget
# searches (three left keras-hub GPT-2's budget(time=1.075) at 309.6 MiB, where
# budget(0.5)'s plan peaks at 293.6 and is predicted at 1.0749x).
REFINED = 0.01
REFINEMENTS = 12


@dataclasses.dataclass(frozen=True)
class Offloadable:
    """What a budget search may offload, and what offloading costs.

    Attributes:
      tensors: tensor ids that may be offloaded (memsave.offload.Offloader.may_offload).
      prefetch, flops_per_byte: as memsave.Offload's.
    """
    tensors: frozenset
    prefetch: int = costs.DEFAULT_PREFETCH
    flops_per_byte: float = costs.DEFAULT_FLOPS_PER_BYTE


def _subsets(tensors):
    for r in range(1, len(tensors) + 1):
        for subset in itertools.combinations(tensors, r):
            yield list(subset)


def _subsets_with_offload(tensors, offloadable):
    """(plan, offloaded) for every subset of `tensors` and every subset of its offloadable
    members (none when `offloadable` is None)."""
    for plan in _subsets(tensors):
        yield plan, []
        if offloadable is not None:
            for offloaded in _subsets([t for t in plan if t in offloadable.tensors]):
                yield plan, offloaded


class _Search:
    """Predictions of candidate plans, each simulated once."""

    def __init__(self, model, offloadable=None, read_checkpoints=False, read_last_segment=False):
        self.model = model
        self.offloadable = offloadable if offloadable and offloadable.tensors else None
        # (as MemoryModel.predict's: the kind of plan searched)
        self.flags = dict(read_checkpoints=read_checkpoints, read_last_segment=read_last_segment)
        self.candidates = Candidates(model.graph)
        self._cuts = {}   # segment bytes -> plan

    def predict(self, plan, offloaded=(), allocator=False):
        if not offloaded:  # (the model keeps every prediction it made)
            return self.model.predict(plan, allocator=allocator, **self.flags)
        return self.model.predict(plan, offloaded, self.offloadable.prefetch,
                                  self.offloadable.flops_per_byte, allocator=allocator,
                                  **self.flags)

    def cost(self, plan, offloaded=()):
        """The cost_flops of predict(plan, offloaded), without simulating it."""
        if not offloaded:
            return self.model.cost_of(plan, **self.flags)
        return self.model.cost_of(plan, offloaded, self.offloadable.flops_per_byte,
                                  **self.flags)

    def fits(self, plan, offloaded, limit_bytes, allocator=True, live_limit=None):
        """Whether `plan` peaks within `limit_bytes`: its live tensors (and `live_limit`),
        and (`allocator`) the chunks the device's allocator holds for them, where the
        model simulates one."""
        if self.predict(plan, offloaded).peak_bytes > min(limit_bytes, live_limit or limit_bytes):
            return False  # (the allocator never holds less than the tensors)
        return (not allocator or self.predict(plan, offloaded, allocator=True).device_peak_bytes
                <= limit_bytes)

    def fit(self, plan, limit_bytes, allocator=True, live_limit=None):
        """(Prediction, plan, offloaded) of `plan` within `limit_bytes` (and `live_limit`,
        as `fits`): as it is, or with the fewest of its checkpoints offloaded (earliest
        first), or None.

        The fewest offloaded whose live tensors fit is found first (no replay); the
        allocator's chunks never hold less, so its answer is searched from there up."""
        if self.fits(plan, [], limit_bytes, allocator, live_limit):
            return self.predict(plan, allocator=allocator), list(plan), []
        movable = self.movable(plan)
        if not movable or not self.fits(plan, movable, limit_bytes, allocator, live_limit):
            return None

        def fits_keeping(kept, allocator):  # (kept: how many of the latest stay on the device)
            return self.fits(plan, movable[:len(movable) - kept], limit_bytes, allocator,
                             live_limit)

        kept = _longest(0, len(movable) - 1, lambda count: fits_keeping(count, False))
        if allocator:
            kept = _longest_from(kept, lambda count: fits_keeping(count, True))
        offloaded = movable[:len(movable) - kept]
        return self.predict(plan, offloaded, allocator=allocator), list(plan), offloaded

    def movable(self, plan):
        """The checkpoints of `plan` that may be offloaded, made earliest first."""
        if self.offloadable is None:
            return []
        producer = self.model.graph.producer
        return sorted((t for t in plan if t in self.offloadable.tensors),
                      key=lambda t: producer[t])

    def cut_plan(self, segment_bytes):
        plan = self._cuts.get(segment_bytes)
        if plan is None:
            candidates = self.candidates
            plan = self._cuts[segment_bytes] = candidates.tensors_crossing(
                candidates.greedy_cuts(segment_bytes))
        return plan

    def cut_plans(self):
        """The greedy plans over a coarse range of segment sizes, refined around the
        lowest peak (the peak falls, then rises again, as segments grow)."""
        sizes = self.candidates.segment_sizes()
        coarse = sizes[::3] + ([sizes[-1]] if (len(sizes) - 1) % 3 else [])
        scored = [(self._peak_of(size), size) for size in coarse]
        best = min(range(len(coarse)), key=lambda i: scored[i][0])
        low = sizes.index(coarse[max(best - 1, 0)])
        high = sizes.index(coarse[min(best + 1, len(coarse) - 1)])
        for size in sizes[low:high + 1]:
            self._peak_of(size)
        return [plan for plan in (self.cut_plan(size) for size in sizes if size in self._cuts)
                if plan]

    def all_cut_plans(self):
        """The greedy plans over every segment size of the range."""
        plans = (self.cut_plan(size) for size in self.candidates.segment_sizes())
        return [plan for plan in plans if plan]

    def _peak_of(self, size):
        plan = self.cut_plan(size)
        return self.predict(plan).peak_bytes if plan else float("inf")

    def best(self, plans, fits=lambda prediction: True, by_cost=False, smallest_segments=False):
        """(Prediction, plan) of the best plan that fits, or None.

        by_cost: least recomputation first. Otherwise lowest peak first, where peaks
        within PEAK_TIE of the lowest count as equal (the model is not that exact)
        and the tie goes to less recomputation; with `smallest_segments`, of the plans
        within NEAR_LOWEST of the lowest peak that recompute no more than that choice,
        the one recomputing least per segment, then least in all.
        """
        found = [(self.predict(plan), list(plan)) for plan in plans]
        found = [(prediction, plan) for prediction, plan in found if fits(prediction)]
        if not found:
            return None
        if by_cost:
            return min(found, key=lambda f: (f[0].recompute_flops, f[0].peak_bytes))
        lowest = min(prediction.peak_bytes for prediction, _ in found)
        tied = [f for f in found if f[0].peak_bytes <= lowest * (1 + PEAK_TIE)]
        chosen = min(tied, key=lambda f: (f[0].recompute_flops, f[0].peak_bytes))
        if not smallest_segments:
            return chosen
        near = [f for f in found if f[0].peak_bytes <= lowest * (1 + NEAR_LOWEST)
                and f[0].recompute_flops <= chosen[0].recompute_flops]
        return min(near, key=lambda f: (f[0].recompute_flops / max(f[0].segments, 1),
                                        f[0].recompute_flops))

    def with_expensive_outputs(self, plan, expensive, limit_bytes, live_limit=None):
        """`plan` plus the longest prefix of `expensive` (best saving per byte first)
        that keeps the predicted peak <= limit_bytes (and `live_limit`, as `fits`),
        offloading where that is allowed and needed. The longest prefix whose live
        tensors fit is found first (binary search, no replay); the allocator's chunks
        never hold less, so its answer is searched from there down."""
        chosen = set(plan)
        extra = [t for t in expensive if t not in chosen]

        def fits(count, allocator):
            return self.fit(list(plan) + extra[:count], limit_bytes, allocator,
                            live_limit) is not None

        most = _longest(0, len(extra), lambda count: fits(count, False))
        return list(plan) + extra[:_longest_from(most, lambda count: fits(count, True))]


def _longest(low, high, ok):
    """The largest n in [low, high] with ok(n), for `ok` true up to some n and false
    after it (binary search); `low` when there is none."""
    while low < high:
        middle = (low + high + 1) // 2
        if ok(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _longest_from(high, ok):
    """_longest(0, high, ok), probing from `high` down: high, high - 2, high - 6,
    high - 14, ... until one is ok, then a binary search in the last step. Costs one
    probe where `high` is the answer, and few where it is near it."""
    failed, step = high + 1, 1
    while failed > 0:
        candidate = max(failed - step, 0)
        if candidate == 0 or ok(candidate):
            return _longest(candidate, failed - 1, ok)
        failed, step = candidate, step * 2
    return 0


def minimise_peak(model, exact=None, expensive=(), tolerance=0.0, smallest_segments=False):
    """(Prediction, checkpoint tensor ids) of the plan with the lowest predicted peak.

    Args:
      model: the MemoryModel.
      exact: try every subset (default: when there are few candidates).
      expensive: tensor ids worth keeping to save recomputation; kept too as long
        as the peak stays within `tolerance` of the lowest.
      tolerance: how much above the chosen plan's peak (a fraction; of the peak as
        the device's allocator holds it, where the model replays one) buys less
        recomputation.
      smallest_segments: of the cut plans nearly lowest, the one with the smallest
        segments (_Search.best; 'memory'), up to NEAR_LOWEST above the lowest.
    Returns:
      (Prediction, plan), or None when there is nothing to keep.
    """
    search = _Search(model)
    if exact is None:
        exact = len(search.candidates.tensors) <= EXACT_PEAK_LIMIT
    best = search.best(_subsets(search.candidates.tensors) if exact else search.cut_plans(),
                       smallest_segments=smallest_segments and not exact)
    if best is None or not expensive or exact:
        return best
    # (both: held alone let live rise, a fit MLP 94.1 MiB for 86.4; live within PEAK_TIE, as `best`)
    held = search.predict(best[1], allocator=True).device_peak_bytes
    limit = int(held * (1 + tolerance))
    live_limit = int(best[0].peak_bytes * (1 + tolerance + PEAK_TIE))
    expensive = outside_last_segment(model.graph, best[1], expensive)
    plans = [search.with_expensive_outputs(best[1], order, limit, live_limit)
             for order in rankings(model.graph, expensive)]
    return search.best([best[1]] + plans, fits=lambda p: p.peak_bytes <= live_limit,
                       by_cost=True)


def within_budget(model, limit_bytes, expensive, exact=None, augmented=3, offloadable=None,
                  read_checkpoints=(True, False), read_last_segment=False):
    """The least costly plan with peak <= limit_bytes: (Prediction, checkpoint ids,
    offloaded ids), or None when no plan fits. Plans whose segments read their
    checkpoints (MemoryModel.predict's read_checkpoints; the Prediction says) are
    searched as well as plans that recompute them: reading costs less and may hold more.

    Args:
      model: the MemoryModel.
      limit_bytes: the budget.
      expensive: tensor ids worth keeping to save recomputation (outputs of
        matmuls and convolutions).
      exact: try every subset (default: when there are few candidates).
      augmented: how many of the fitting cut plans (least cost first) are tried with
        expensive outputs added.
      offloadable: an Offloadable, where checkpoints may be offloaded instead of
        recomputed (the cost is then recomputation plus transfers).
      read_checkpoints: the kinds of plan searched (whether segments read their
        checkpoints: MemoryModel.predict's read_checkpoints).
      read_last_segment: whether the plans searched read their last segment from the
        forward pass (MemoryModel.predict's; the Prediction says where one may not): its
        recomputation then costs nothing, so a plan with a long last segment may be the
        cheapest. Where none of them fits, plans recomputing it are searched.
    """
    found = [_within_budget(_Search(model, offloadable, read, read_last_segment), limit_bytes,
                            expensive, exact, augmented) for read in read_checkpoints]
    found = [f for f in found if f is not None]
    if not found and read_last_segment:
        # (reading it holds more where forward ops after it hold the peak: a plan
        # recomputing it may fit where none reading it does)
        return within_budget(model, limit_bytes, expensive, exact, augmented, offloadable,
                             read_checkpoints, read_last_segment=False)
    return min(found, key=lambda f: (f[0].cost_flops, f[0].device_peak_bytes), default=None)


def _within_budget(search, limit_bytes, expensive, exact, augmented):
    """within_budget for plans of one kind (`search.flags`)."""
    model = search.model
    tensors = search.candidates.tensors
    if exact is None:
        exact = len(tensors) <= (EXACT_BUDGET_LIMIT if search.offloadable is None
                                 else EXACT_OFFLOAD_LIMIT)
    if exact:
        return _cheapest_subset(search, _subsets_with_offload(tensors, search.offloadable),
                                limit_bytes)
    # (with offload, every segment size: fine cuts offloaded reach peaks nothing else does)
    plans = search.cut_plans() if search.offloadable is None else search.all_cut_plans()
    # (live tensors first, no replay: the allocator is asked about the plans filled below
    # and, at the end, about the cheapest until one fits)
    found = [f for f in (search.fit(plan, limit_bytes, allocator=False) for plan in plans)
             if f is not None]
    orders = [order for order in rankings(model.graph, expensive) if order]
    if orders and found:
        found.sort(key=lambda f: f[0].cost_flops)
        roomiest = min(found, key=lambda f: f[0].peak_bytes)  # (room for the most outputs)
        bases = _first_fitting(search, found, limit_bytes, augmented)
        # (in each order of memsave.planner.expensive: the outputs, their chains' ends)
        for _, plan, _ in bases + ([roomiest] if roomiest not in bases else []):
            for order in orders:
                fitted = search.fit(search.with_expensive_outputs(plan, order, limit_bytes),
                                    limit_bytes)
                if fitted is not None:
                    found.append(fitted)
    if len(tensors) <= LOCAL_SEARCH_LIMIT:
        # (one-checkpoint plans too: dropping one checkpoint at a time from the cut
        # plans, it may stop short of them: a random DAG of 14 ops, 3.49 MFLOP where one
        # checkpoint that fits recomputes 2.89)
        singles = [[t] for t in tensors]
        found.append(improved(search, plans + [f[1] for f in found] + singles, limit_bytes))
    if search.offloadable is not None:  # never costlier than the plan without offload
        found.append(_within_budget(_Search(model, None, **search.flags),
                                    limit_bytes, expensive, exact, augmented))
    return _cheapest(search, (f for f in found if f is not None), limit_bytes)


def _first_fitting(search, found, limit_bytes, count):
    """The first `count` of `found` (each fitting by its live tensors) that fit as the
    device's allocator holds them."""
    fitting = []
    for _, plan, _ in found:
        if len(fitting) == count:
            break
        fitted = search.fit(plan, limit_bytes)
        if fitted is not None:
            fitting.append(fitted)
    return fitting


def _cheapest(search, found, limit_bytes):
    """The (Prediction, plan, offloaded) of least cost (then lowest peak) whose peak as
    the device's allocator holds it fits `limit_bytes`, or None.

    The live tensors' peak of each of `found` fits already; the allocator's is never
    lower (its chunks are at least the tensors' sizes), and is replayed only for the
    cheapest plans, until one fits.
    """
    for _, plan, offloaded in sorted(found, key=lambda f: (f[0].cost_flops, f[0].peak_bytes)):
        held = search.predict(plan, offloaded, allocator=True)
        if held.device_peak_bytes <= limit_bytes:
            return held, plan, offloaded
    return None


def _cheapest_subset(search, plans, limit_bytes):
    """_cheapest over those of `plans` ((plan, offloaded) pairs) whose live tensors fit,
    simulated a cost at a time (MemoryModel.cost_of), least first, until one fits: the
    same answer as simulating them all (of 2**10 subsets, most cost more)."""
    by_cost = {}
    for plan, offloaded in plans:
        by_cost.setdefault(search.cost(plan, offloaded), []).append((plan, offloaded))
    for cost in sorted(by_cost):
        predicted = ((search.predict(plan, offloaded), plan, offloaded)
                     for plan, offloaded in by_cost[cost])
        found = _cheapest(search, [f for f in predicted if f[0].peak_bytes <= limit_bytes],
                          limit_bytes)
        if found is not None:
            return found
    return None


def lowest_reachable_peak(model, offloadable=None):
    """The lowest peak memsave finds on this step, as the device's allocator holds it
    (with every movable checkpoint offloaded, where offload is allowed: over every cut
    plan, the lowest tensors' peak replayed); None if nothing can be kept."""
    best = minimise_peak(model)
    if best is None:
        return None
    search = _Search(model, offloadable)
    plan, offloaded = best[1], []
    if search.offloadable is not None:
        plans = search.all_cut_plans() + [best[1]]
        plan = min(plans, key=lambda p: search.predict(p, search.movable(p)).peak_bytes)
        offloaded = search.movable(plan)
    return min(search.predict(best[1], allocator=True).device_peak_bytes,
               search.predict(plan, offloaded, allocator=True).device_peak_bytes)


def lowest_peak_within_cost(model, max_cost, expensive, offloadable=None,
                            read_checkpoints=(True, False), read_last_segment=False,
                            refinements=REFINEMENTS, replayed=3):
    """The plan with the lowest predicted peak (as the device's allocator holds it) whose
    cost, recomputation and transfers, is at most `max_cost`: (Prediction, checkpoint
    ids, offloaded ids), or None where no plan found costs that little.

    The plans searched read their last segment where `read_last_segment` (as
    within_budget's). The greedy cuts over every segment size (of each kind of plan)
    and the lowest-peak plan are tried first, the `replayed` lowest of them by live
    tensors replayed through the allocator; the best is then lowered by budget searches
    (`_bisected`, at most `refinements`).
    """
    searches = {read: _Search(model, None, read, read_last_segment) for read in read_checkpoints}
    searches.setdefault(False, _Search(model, None, False, read_last_segment))
    found = []
    for read in read_checkpoints:
        search = searches[read]
        found += [(search.predict(plan), list(plan), read) for plan in search.all_cut_plans()]
    lowest = minimise_peak(model)
    if lowest is not None:  # (predicted as this search's plans are)
        found.append((searches[False].predict(lowest[1]), lowest[1], False))
    found = sorted((f for f in found if f[0].cost_flops <= max_cost),
                   key=lambda f: (f[0].peak_bytes, f[0].cost_flops))
    held = [(searches[read].predict(plan, allocator=True), plan, [])
            for _, plan, read in found[:replayed]]
    best = min(held, key=lambda f: (f[0].device_peak_bytes, f[0].cost_flops), default=None)
    low = lowest_reachable_peak(model, offloadable)
    if low is None:
        return best

    def cheapest_under(limit):  # (None where the least costly plan costs too much)
        cheapest = within_budget(model, limit, expensive, offloadable=offloadable,
                                 read_checkpoints=read_checkpoints,
                                 read_last_segment=read_last_segment)
        return cheapest if cheapest is not None and cheapest[0].cost_flops <= max_cost else None

    return _bisected(cheapest_under, best, model.baseline(allocator=True), low, refinements)


def _bisected(cheapest_under, best, baseline, low, refinements):
    """`best` lowered by bisecting the limit between `low` and its peak (tf.gradients'
    where `best` is None) with `cheapest_under(limit)`, a plan within the cost under
    `limit` or None, until the two are within REFINED of the upper, in at most
    `refinements` calls.

    `low`, the lowest peak memsave finds ('memory''s plan), is no bound: a budget's search
    may find a lower one (benchmarks' Keras-layer GPT, 2 blocks, batch 2: 53.4 MiB within
    1.0933x its step time, where 'memory''s plan peaks at 54.3). So where the bisection
    closes on it, the limit at `low` itself is tried once, and a plan within the cost
    well under it opens the bracket down to nothing."""
    high = (best[0] if best else baseline).device_peak_bytes
    floor_tried = False
    for _ in range(refinements):
        if high - low > max(int(high * REFINED), 1):
            limit = (low + high) // 2
        elif floor_tried:
            break
        else:
            floor_tried, limit = True, low
        cheapest = cheapest_under(limit)
        if cheapest is None:
            low = limit
            continue
        best, high = cheapest, cheapest[0].device_peak_bytes
        if limit == low and high < low - max(int(low * REFINED), 1):
            low = 0
    return best
