"""Strategies founded on the memory model (memsave.planner).

- `lowest_peak()` ('memory'): the checkpoints that minimise the step's predicted
  peak, ties going to less recomputation, with matmul and convolution outputs kept
  where that peak holds them too;
- `budget(limit)`: the least recomputation whose predicted peak fits in `limit`
  bytes (an int) or in that fraction of plain tf.gradients' predicted peak; with
  `offload=`, large checkpoints may go to host memory instead of being
  recomputed, where the transfer costs less;
- `budget(time=T)`: the other corner of the trade, the lowest predicted peak whose
  predicted step time is at most T times plain tf.gradients'.
"""

import math
import numbers

from memsave import offload as offload_lib
from memsave import planner
from memsave.errors import MemsaveError
from memsave.planner import costs, search
from memsave.planner.opinfo import EXPENSIVE_OP_TYPES
from memsave.planner.calibrated import MemoryCalibration
from memsave.strategies.base import Choice, Selection


def _mb(n):
    return f"{n / 2**20:.3g} MiB"


def _choices(model, plan, reason, offloaded=None):
    """Choices of the tensor ids in `plan`; `offloaded`: the ids a planner chose to
    offload (None: it decided nothing about offload)."""
    graph = model.graph
    if offloaded is None:
        return [Choice(graph.tensors[t], reason) for t in plan]
    offloaded = set(offloaded)
    return [Choice(graph.tensors[t], reason, t in offloaded) for t in plan]


def _expensive_outputs(graph):
    """Tensor ids of the outputs of expensive ops (opinfo.EXPENSIVE_OP_TYPES) in the
    region: worth keeping to recompute less."""
    return [t for op in graph.region_op_ids() if graph.ops[op].type in EXPENSIVE_OP_TYPES
            for t in graph.outputs[op] if graph.tensors[t].dtype.is_floating and not graph.is_y[t]]


def lowest_peak(tolerance=0.0):
    """A strategy keeping the checkpoints with the lowest predicted peak (of the plans
    within search.NEAR_LOWEST of it that recompute no more, the one with the smallest
    segments: what the model leaves out grows with a segment), and then the outputs of
    matmuls and convolutions, best saving per byte first, as long as the peak (as the
    device's allocator holds it) stays within `tolerance` of that plan's, and its live
    tensors' within `tolerance` + search.PEAK_TIE: each one kept is recomputed no more,
    and where the peak is elsewhere it costs no memory.
    (Measured on the benchmarks' default CNN, Intel Xeon with AVX-512, five runs: 36
    checkpoints instead of 15, 1.34x tf.gradients' step time instead of 1.42x, a peak
    of 70.3 MiB (0.17x); benchmarks/JOURNAL.md.)

    Args:
      tolerance: a fraction, e.g. 0.05, of the lowest peak that may be given up for less
        recomputation (more segments: a longer build); 0 (default) gives up none; None
        keeps the lowest-peak plan alone, without matmul or convolution outputs.
    """
    def strategy(problem):
        model = problem.model
        expensive = _expensive_outputs(model.graph) if tolerance is not None else ()
        best = search.minimise_peak(model, expensive=expensive, tolerance=tolerance or 0.0,
                                    smallest_segments=True)
        if best is None:
            return []
        # (ranked by live tensors, the report replays the allocator; of the nearly lowest,
        # the smallest segments: search.NEAR_LOWEST)
        prediction, plan = best
        # Its segments recompute their checkpoints: reading them instead holds each one
        # through the next segment's backward pass (on a chain, one tensor more at the
        # peak: tests/test_planner.py), and the lowest peak is what was asked for. Nor do
        # they recompute ahead: that only adds what runs at once (ResNet50: +15%, measured).
        # And its segments' large gradient ops run in one order, the model's: an executor
        # running two side by side holds both (MobileNetV2: 79-115 MB with one plan).
        lowest = (f"lowest predicted peak of live tensors ({_mb(prediction.peak_bytes)} with "
                  f"{len(plan)} checkpoints)")
        # (said of every matmul or convolution output kept: the lowest-peak plan may hold
        # some of its own, and minimise_peak does not say which ones the fill added)
        spared = set(expensive)
        return Selection([Choice(model.graph.tensors[t],
                                 f"{lowest}; a matmul or convolution output: keeping it "
                                 "spares its recomputation" if t in spared else lowest)
                          for t in plan],
                         read_checkpoints=False, recompute_ahead=False, order_backward=True)
    strategy.__name__ = "lowest_peak"
    return strategy


class budget:  # noqa: N801 (reads as a function at the call site: checkpoints=memsave.budget(...))
    """A strategy: the least recomputation whose predicted peak fits in `limit`, or the
    lowest predicted peak whose predicted step time fits in `time`.

    Usable wherever `checkpoints=` is accepted: memsave.gradients(loss, xs,
    checkpoints=memsave.budget(0.5)), checkpoints=memsave.budget(time=1.2).

    Args:
      limit: bytes (an int > 0), or a fraction in (0, 1] of plain tf.gradients'
        predicted peak for the same step; None with `time`.
      unknown_dim_size: the size the memory model assumes for unknown dimensions
        (e.g. the batch of a [None, ...] placeholder); default 1.
      offload: as `memsave.gradients`' `offload=` (False, True, a device string or
        memsave.Offload): checkpoints may then wait in host memory instead of being
        recomputed; the plan offloads those whose transfer costs less than the
        recomputation keeping them saves (Offload.flops_per_byte). The call's own
        `offload=` works the same way (give it in one place, or the same in both).
      calibration: a memsave.calibrate_memory measurement of this step, or None. With
        one, a fraction is of tf.gradients' *measured* peak, and each plan's predicted
        peak is scaled to the measurement (memsave.planner.calibrated.Calibrated) before it is
        compared with the limit; the report says so (`memory_calibration`).
      time: the most step time to accept, as a multiple of plain tf.gradients' (a
        number > 1, e.g. 1.2), as the cost model predicts it (report.step_time_ratio:
        the step's three forward passes plus the recomputation; what the rewrite costs
        beyond that is not in it: benchmarks/time_breakdown.py). The plan is then the
        lowest predicted peak within it (and within `limit` where one is given too).
    Raises:
      MemsaveError: for a bad limit, offload or calibration (here), and, when the
        gradients are built, for a limit that no plan meets (naming the smallest
        reachable peak) or a calibration of another step.
    """

    def __init__(self, limit=None, unknown_dim_size=None, offload=False, calibration=None,
                 time=None):
        self.time = _checked_time(time)
        if limit is None and self.time is not None:
            self.limit = None
        else:
            self.limit = _checked_limit(limit)
        self.unknown_dim_size = planner.check_unknown_dim_size(unknown_dim_size)
        self.offload = offload_lib.normalise(offload)
        if calibration is not None and not isinstance(calibration, MemoryCalibration):
            raise MemsaveError(f"budget's calibration is a {type(calibration).__name__}; pass "
                               "what memsave.calibrate_memory(step, ...) returns, or None")
        self.calibration = calibration
        self.__name__ = f"budget({self._arguments()})"

    def _arguments(self):
        given = [] if self.limit is None else [repr(self.limit)]
        return ", ".join(given + ([] if self.time is None else [f"time={self.time!r}"]))

    def __repr__(self):
        offload = f", offload={self.offload!r}" if self.offload else ""
        return f"memsave.budget({self._arguments()}{offload})"

    def limit_bytes(self, model, calibrated=None):
        """The limit in bytes: a fraction is of tf.gradients' predicted peak, or with a
        calibration (`calibrated`: memsave.planner.calibrated.Calibrated) of its measured one;
        None where there is no limit (a time budget)."""
        if self.limit is None or not isinstance(self.limit, float):
            return self.limit
        if calibrated is not None:
            return int(self.limit * calibrated.calibration.peak_bytes)
        return int(self.limit * model.baseline(allocator=True).device_peak_bytes)

    def __call__(self, problem):
        # (problem.unknown_dim_size is this budget's, where it gives one: the call's
        # pipeline reads it before the memory model is built.)
        graph = problem.region.ys[0].graph
        if self.calibration is not None:
            self.calibration.check_measures(graph)
        model = problem.model
        baseline = model.baseline(allocator=True)
        calibrated = None
        if self.calibration is not None:
            dims_measured = (self.unknown_dim_size is None and bool(model.graph.unknown_dims)
                             and self.calibration.unknown_dim_size(graph)
                             == model.graph.unknown_dim_size)
            calibrated = self.calibration.calibrated(baseline.device_peak_bytes,
                                                     baseline.resident_bytes, dims_measured)
        shown = calibrated.measured if calibrated is not None else (lambda n: n)
        if self.time is not None:
            return self._within_time(problem, baseline, calibrated, shown)
        limit = self.limit_bytes(model, calibrated)
        if calibrated is not None and limit <= self.calibration.before_bytes:
            raise MemsaveError(
                f"the budget of {_mb(limit)} is below the {_mb(self.calibration.before_bytes)} "
                "in use before the measured step (weights, inputs, optimizer slots); raise it")
        model_limit = calibrated.model(limit) if calibrated is not None else limit
        # (tf.gradients' peak as measured where there is a measurement, else as predicted.)
        tf_peak, tf_kind = ((calibrated.calibration.peak_bytes, "measured") if calibrated
                            else (baseline.device_peak_bytes, "predicted"))
        if tf_peak <= limit:
            return Selection(plain=f"tf.gradients' {tf_kind} peak {_mb(tf_peak)} fits the "
                                   f"budget of {_mb(limit)}: nothing to recompute",
                             calibrated=calibrated)
        offloadable = _offloadable(model, problem)
        environment = problem.environment
        best = search.within_budget(
            model, model_limit, _expensive_outputs(model.graph), offloadable=offloadable,
            read_checkpoints=(True, False) if environment.may_read_checkpoints else (False,),
            read_last_segment=environment.may_read_last_segment)
        if best is None:
            reachable = search.lowest_reachable_peak(model, offloadable)
            reachable = shown(baseline.device_peak_bytes if reachable is None else reachable)
            hint = "" if offloadable else " or use checkpoints='memory'"
            raise MemsaveError(
                f"the budget of {_mb(limit)} cannot be met: the smallest {_peak_kind(calibrated)} "
                f"peak memsave can reach on this graph{' with offload' if offloadable else ''} "
                f"is {_mb(reachable)} (tf.gradients {tf_kind}: {_mb(tf_peak)}); raise the "
                f"budget to at least {_mb(reachable)}{hint}")
        prediction, plan, offloaded = best
        prediction = _ahead_if_it_fits(model, environment, prediction, plan, offloaded,
                                       model_limit)
        choices = _choices(model, plan, f"within budget {_mb(limit)} ({_peak_kind(calibrated)} "
                                        f"peak {_mb(shown(prediction.device_peak_bytes))})",
                           offloaded if offloadable else None)
        return Selection(choices, read_checkpoints=prediction.reads_checkpoints,
                         recompute_ahead=prediction.recomputes_ahead,
                         read_last_segment=prediction.reads_last_segment, calibrated=calibrated)

    def _within_time(self, problem, baseline, calibrated, shown):
        """The lowest predicted peak whose predicted step time is within self.time; with a
        limit too, refused where that peak is over the limit."""
        model = problem.model
        limit = self.limit_bytes(model, calibrated)
        max_cost = int((self.time - 1) * costs.step_flops(model.forward_flops,
                                                          model.loop_sums_flops))
        best = search.lowest_peak_within_cost(
            model, max_cost, _expensive_outputs(model.graph),
            offloadable=_offloadable(model, problem),
            read_checkpoints=((True, False) if problem.environment.may_read_checkpoints
                              else (False,)),
            read_last_segment=problem.environment.may_read_last_segment)
        if best is None or best[0].device_peak_bytes >= baseline.device_peak_bytes:
            # Plain tf.gradients is the lowest peak within the time.
            prediction, plan, offloaded = baseline, None, None
        else:
            prediction, plan, offloaded = best
        peak = shown(prediction.device_peak_bytes)
        if limit is not None and peak > limit:
            raise MemsaveError(
                f"the budget of {_mb(limit)} within {self.time:g}x tf.gradients' step time "
                f"cannot be met: the lowest {_peak_kind(calibrated)} peak within that time is "
                f"{_mb(peak)}; raise the limit to at least {_mb(peak)} or the time")
        if plan is None:
            return Selection(plain=f"no plan within {self.time:g}x tf.gradients' predicted step "
                                   "time peaks lower: plain tf.gradients", calibrated=calibrated)
        ratio = costs.step_time_ratio(prediction.cost_flops, prediction.forward_flops,
                                      prediction.loop_sums_flops)
        choices = _choices(model, plan, f"lowest {_peak_kind(calibrated)} peak within "
                                        f"{self.time:g}x tf.gradients' step time (predicted "
                                        f"{ratio:.2f}x, {_mb(peak)})",
                           offloaded if problem.offload is not None else None)
        return Selection(choices, read_checkpoints=prediction.reads_checkpoints,
                         recompute_ahead=False, read_last_segment=prediction.reads_last_segment,
                         calibrated=calibrated)


def _checked_limit(limit):
    """A budget's limit as given: bytes (an int > 1) or a fraction in (0, 1]."""
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise MemsaveError(f"budget limit is {limit!r}; pass bytes (an int, e.g. 512 * 2**20) "
                           "or a fraction in (0, 1] of tf.gradients' peak (e.g. 0.5), or a "
                           "step time (time=1.2)")
    if isinstance(limit, numbers.Integral) and limit > 1:
        return int(limit)
    if 0 < limit <= 1:  # (NaN fails this too)
        return float(limit)
    raise MemsaveError(f"budget limit is {limit!r}; pass bytes (an int > 1) or a fraction "
                       "in (0, 1] of tf.gradients' peak (e.g. 0.5), or a step time (time=1.2)")


def _checked_time(time):
    """A budget's time: None, or a multiple > 1 of tf.gradients' step time."""
    if time is None:
        return None
    if (isinstance(time, bool) or not isinstance(time, numbers.Real) or math.isnan(time)
            or time <= 1 or math.isinf(time)):
        raise MemsaveError(f"budget time is {time!r}; pass the most step time you accept as "
                           "a multiple of tf.gradients' (a finite number > 1, e.g. time=1.2)")
    return float(time)


def _peak_kind(calibrated):
    return "predicted" if calibrated is None else "calibrated"


def _ahead_if_it_fits(model, environment, prediction, plan, offloaded, limit):
    """The prediction of `plan` recomputing ahead where that still fits `limit`
    (MemoryModel.predict's recompute_ahead: the same recomputation, off the backward
    pass's critical path on an executor that runs ops side by side; its tensors live a
    segment longer), else `prediction`."""
    if offloaded or not environment.may_recompute_ahead:
        return prediction
    flags = prediction.flags(recompute_ahead=True)
    # Live tensors first: the allocator never holds less, so a plan whose tensors
    # overrun the limit is not replayed (as search._Search.fits).
    if model.predict(plan, **flags).peak_bytes > limit:
        return prediction
    ahead = model.predict(plan, allocator=True, **flags)
    return ahead if ahead.device_peak_bytes <= limit else prediction


def _offloadable(model, problem):
    """What the call may offload (memsave.planner.search.Offloadable), or None."""
    options = problem.offload
    if options is None:
        return None
    graph, accelerator = model.graph, problem.offload_accelerator
    tensors = frozenset(t for op in graph.region_op_ids() for t in graph.outputs[op]
                        if offload_lib.may_offload(graph.tensors[t], options, accelerator,
                                                   graph.unknown_dim_size))
    return search.Offloadable(tensors, options.prefetch, options.flops_per_byte)
