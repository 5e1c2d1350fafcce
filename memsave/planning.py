"""Planning: from a strategy's choices to one frozen `Plan` the builder builds.

Every decision about a call is made here, once, and written into the Plan: which
checkpoints (the strategy's, plus the tensors every plan must end segments at and
those several segments would read), which of them wait in host memory, whether
segments read their checkpoints or recompute them, whether they recompute ahead,
whether their large gradient ops are ordered, the parts of the backward pass in
their order, the memory model's prediction, and whether plain tf.gradients answers
instead (and why). Nothing is added to the graph: `memsave.plan(...)` is this alone.
"""

import dataclasses
import logging
import warnings
from typing import FrozenSet, Optional, Tuple

import tensorflow as tf

from memsave import backward
from memsave import offload as offload_lib
from memsave import plan_variants
from memsave import report as report_lib
from memsave.environment import Environment
from memsave.errors import MemsaveError, MemsaveWarning
from memsave.graph import _tf_private, calls
from memsave.graph.select import TensorSet
from memsave.beside import Beside
from memsave.planner.calibrated import Calibrated
from memsave.planner.curves import Curve
from memsave.planner.graph import RESIDENT, StepGraph
from memsave.planner.loops import why_not_recomputed as why_loop_kept
from memsave.planner.memory import Prediction
from memsave.planner.segments import LAST, ForwardReads, Segmentation
from memsave.region import NOT_RECOMPUTABLE, ForwardRegion
from memsave.strategies import Choice, selection_of

logger = logging.getLogger(__name__)

# A plan must predict at least this much less than tf.gradients to be used.
_MIN_PREDICTED_SAVING = 0.02
# Gradient ops whose outputs hold at least 1/_LARGE_FRACTION of the step's largest
# tensor, or that read a tensor that large, are "large" (Plan.orders_backward), if that
# is also at least _ORDERED_SHARE of the plan's predicted peak. An executor running one
# op out of the model's order (beside another, or after the next segment's copies)
# holds at most that op's tensors beside what the model holds: ops under 3% of the
# peak can move it by about twice that, the ordered peaks' own run-to-run spread,
# while their order costs a CPU's executor its overlap. Measured (AMD EPYC with
# AVX-512, family 26), the default CNN, whose largest tensor is 2.8% of its peak:
# 'memory' at 1.37x [1.35-1.38] ordered and 1.31x [1.31-1.35] not, peaks 69.7 MiB
# [68.1-71.2] and 70.7 [70.3-74.2] (71.5 predicted); keras-hub GPT-2's 62.5 MiB logits
# gradient, 42% of its peak, 144-155 MiB ordered and 152-173 not.
_LARGE_FRACTION = 16
_ORDERED_SHARE = 0.03

@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the builder builds, decided.

    Attributes:
      strategy: the strategy's name, for the report.
      region: the memsave.region.ForwardRegion.
      environment: the memsave.environment.Environment it was made for.
      step_graph: the memory model's StepGraph (op and tensor ids, what is small,
        which weight gradients are made last).
      checkpoints: the kept Choices, in forward order: the strategy's, those every plan
        must end segments at, and those several segments read (each with its reason).
      dropped: (tensor name, why) of the choices that could not be kept.
      offloaded: names of the checkpoints that wait in host memory.
      offload: the memsave.Offload they go with (prefetch), or None.
      reads_checkpoints: segments read the checkpoint they end at as the forward pass
        made it (ForwardReads), not from a recomputed copy.
      recomputes_ahead: each segment's copies wait for the previous segment's trigger.
      reads_last_segment: the last segment's gradients read its tensors as the forward
        pass made them (ForwardReads): it recomputes nothing.
      orders_backward: each segment's large gradient ops run one after another: those
        whose outputs hold at least `large_bytes`, or that read a tensor that large
        (False where no tensor is that large).
      large_bytes: 1/16 of the step's largest tensor, or 3% of the plan's predicted
        peak where that is more (_ORDERED_SHARE).
      serializes_conv_gradients: each copied convolution's input gradient waits for
        its filter gradient (TensorFlow's own CPU kernels: one im2col buffer at a time).
      forward_reads: which tensors segments' gradients read from the forward pass.
      deferred: tensor ids (of step_graph) whose gradients are made after the last
        segment's backward pass: weight gradients larger than what they read
        (StepGraph.deferred; none under gate_gradients).
      parts: the tf.gradients calls of the rewrite (memsave.backward.Part), in the
        order the backward pass runs them.
      prediction: the memory model's prediction of this plan (None with no checkpoints).
      baseline: its prediction of plain tf.gradients.
      recomputed_loops: the while_v2 loops (kept ops) whose gradient the rewrite takes
        through a recomputing copy (memsave.graph.loops), for all the others TensorFlow's.
      loop_chunks: (loop, iterations per chunk of its copy) for each of those.
      fallback: why plain tf.gradients answers instead, or None.
      warn: whether that fallback deserves a warning (the caller listed checkpoints).
      calibrated: the scale to a measured step the strategy planned with
        (memsave.planner.calibrated.Calibrated), or None.
      unknown_dim_source: where the size of unknown dimensions came from
        (memsave.planner.Problem.unknown_dim_source).
      beside: what the step holds beside the gradients (memsave.beside.Beside), or None.
      baseline_curve, curve: tf.gradients' and the plan's live memory over the step
        (memsave.planner.curves.Curve; the plan's None without checkpoints).
      baseline_range, prediction_range: (least, most) of tf.gradients' and the plan's
        peak as far as TensorFlow runs its gradient loops ahead
        (MemoryModel.peak_range), or None.
    """
    strategy: str
    region: ForwardRegion
    environment: Environment
    step_graph: StepGraph
    checkpoints: Tuple[Choice, ...]
    dropped: Tuple[Tuple[str, str], ...]
    baseline: Prediction
    offloaded: FrozenSet[str] = frozenset()
    offload: Optional[offload_lib.Offload] = None
    reads_checkpoints: bool = False
    recomputes_ahead: bool = False
    reads_last_segment: bool = False
    orders_backward: bool = False
    large_bytes: int = 0
    serializes_conv_gradients: bool = False
    forward_reads: Optional[ForwardReads] = None
    deferred: FrozenSet[int] = frozenset()
    parts: Tuple[backward.Part, ...] = ()
    prediction: Optional[Prediction] = None
    recomputed_loops: FrozenSet[tf.Operation] = frozenset()
    loop_chunks: Tuple[Tuple[tf.Operation, int], ...] = ()
    fallback: Optional[str] = None
    warn: bool = False
    calibrated: Optional[Calibrated] = None
    unknown_dim_source: Optional[str] = None
    beside: Optional[Beside] = None
    baseline_curve: Optional[Curve] = None
    curve: Optional[Curve] = None
    baseline_range: Optional[Tuple[int, int]] = None
    prediction_range: Optional[Tuple[int, int]] = None

    @property
    def checkpoint_tensors(self):
        return [c.tensor for c in self.checkpoints]

    def _note_narrowed(self, report):
        """The checkpoints held as their Cast's narrower input (ForwardReads.narrowed):
        that input's bytes (none where it is held anyway: a checkpoint itself, or alive
        for the whole step), and why."""
        narrowed = self.forward_reads.narrowed if self.forward_reads is not None else {}
        graph = self.step_graph
        kept = {graph.id_of(c.tensor) for c in self.checkpoints}
        for info, choice in zip(report.checkpoints, self.checkpoints):
            source = narrowed.get(graph.id_of(choice.tensor))
            if source is None:
                continue
            narrow = graph.tensors[source]
            held_anyway = source in kept or graph.kind[graph.producer[source]] == RESIDENT
            info.bytes = 0 if held_anyway else graph.size[source]
            info.reason += (f"; held as the Cast's {narrow.dtype.name} input {narrow.name}, "
                            "cast again by each segment that reads it")

    def report(self):
        """The RewriteReport of this plan (the builder adds what it built)."""
        graph, baseline, prediction = self.step_graph, self.baseline, self.prediction
        report = report_lib.RewriteReport(
            strategy=self.strategy, region_ops=len(self.region),
            checkpoints=[report_lib.CheckpointInfo.of(c.tensor, c.reason, graph.unknown_dim_size)
                         for c in self.checkpoints],
            dropped=list(self.dropped),
            not_recomputable=[(op.name, why) for op, why in self.region.kept_ops],
            baseline_peak_bytes=baseline.device_peak_bytes, baseline_peak_at=baseline.device_peak_at,
            resident_bytes=baseline.resident_bytes, unknown_dims=len(graph.unknown_dims),
            unknown_dim_size=int(graph.unknown_dim_size), unknown_dim_source=self.unknown_dim_source,
            fallback=self.fallback,
            beside_bytes=self.beside.resident_bytes if self.beside else 0,
            beside_source=self.beside.source if self.beside else None,
            reads_checkpoints=self.reads_checkpoints, recomputes_ahead=self.recomputes_ahead,
            reads_last_segment=self.reads_last_segment, orders_backward=self.orders_backward,
            ordered_bytes=self.large_bytes if self.orders_backward else 0,
            loops=[(graph.ops[op].name, report_lib.loop_line(
                memory, why_loop_kept(memory, graph.loop_mode, self.fallback is not None)))
                   for op, memory in sorted(graph.loops.items())])
        for info in report.checkpoints:
            info.offloaded = info.name in self.offloaded
        self._note_narrowed(report)
        # Where plain tf.gradients answers, its peak is the one to expect (and the one
        # measured); the declined plan's is kept apart.
        runs_plain = prediction is None or self.fallback is not None
        if prediction is not None and self.fallback is not None:
            report.declined_peak_bytes = prediction.device_peak_bytes
        if self.calibrated is not None:
            measured = self.calibrated.calibration.peak_bytes
            report.memory_calibration = self.calibrated.describe()
            report.measured_baseline_peak_bytes = measured
            report.unknown_dim_size_measured = self.calibrated.dims_measured
            report.calibrated_peak_bytes = (measured if runs_plain else self.calibrated.measured(
                prediction.device_peak_bytes))
        report.baseline_curve = self.baseline_curve
        report.memory_curve = self.baseline_curve if runs_plain else self.curve
        report.baseline_peak_range = self.baseline_range
        report.predicted_peak_range = self.baseline_range if runs_plain else self.prediction_range
        if runs_plain:
            report.predicted_peak_bytes = baseline.device_peak_bytes
            report.predicted_live_bytes = baseline.peak_bytes
            report.peak_at = baseline.device_peak_at
            return report
        report.predicted_peak_bytes = prediction.device_peak_bytes
        report.predicted_live_bytes = prediction.peak_bytes
        report.predicted_host_bytes = prediction.host_bytes
        report.offload_moved_bytes = prediction.moved_bytes  # (the builder counts what it moves)
        report.transfer_flops = prediction.transfer_flops
        report.peak_at = prediction.device_peak_at
        report.recompute_flops = prediction.recompute_flops
        report.deferred_gradients = prediction.deferred_gradients
        report.predicted_segments = prediction.segments
        report.predicted_recomputed_ops = prediction.recomputed_ops
        report.forward_flops = prediction.forward_flops
        report.loop_sums_flops = prediction.loop_sums_flops
        return report


def make_plan(problem, strategy, strategy_name, xs, explicit=False, quiet=False):
    """The Plan of one call.

    Args:
      problem: the call's memsave.planner.Problem.
      strategy: the resolved strategy callable.
      strategy_name: its name for reports.
      xs: the call's xs (graph tensors).
      explicit: whether the caller listed the checkpoints (a fallback then warns).
      quiet: no MemsaveWarning for dropped checkpoints (memsave.plan).
    Returns:
      A Plan (its `fallback` set where plain tf.gradients answers).
    Raises:
      MemsaveError: for a strategy result that is not a list of choices, a budget no
        plan meets.
    """
    region, environment, model = problem.region, problem.environment, problem.model
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", MemsaveWarning)
        selection = selection_of(strategy(problem))
        kept, dropped = _select_checkpoints(selection.choices, region)
    kept, segmentation = _with_shared_tensors(kept, model.graph, region)
    common = dict(strategy=strategy_name, region=region, environment=environment,
                  step_graph=model.graph, unknown_dim_source=problem.unknown_dim_source,
                  beside=problem.beside,
                  dropped=tuple(dropped),
                  baseline=model.baseline(allocator=True), calibrated=selection.calibrated,
                  baseline_range=model.peak_range())
    if not kept:
        return Plan(checkpoints=(), fallback=selection.plain or _no_checkpoints_message(
            strategy_name, region), warn=explicit and selection.plain is None,
            baseline_curve=model.curve(), **common)
    offloaded = _offloaded(kept, problem)
    graph = model.graph
    serializes_conv_gradients = (environment.conv_threads > 0
                                 and any(op.type == "Conv2D" for op in region.ops))
    ids = [graph.id_of(c.tensor) for c in kept]
    offloaded_ids = [graph.id_of(c.tensor) for c in kept if c.tensor.name in offloaded]
    prediction = plan_variants.final_prediction(model, environment, selection, ids,
                                                offloaded_ids, problem.offload)
    prefetch = problem.offload.prefetch if offloaded_ids else 1
    large_bytes = max(graph.largest_bytes // _LARGE_FRACTION,
                      int(_ORDERED_SHARE * prediction.device_peak_bytes))
    decided = dict(
        common, checkpoints=tuple(kept), offloaded=offloaded,
        offload=problem.offload if offloaded else None, prediction=prediction,
        # (after the prediction: a curve re-simulates, and the prediction's allocator
        # replay reuses the search's last simulation where it is the chosen plan's)
        baseline_curve=model.curve(),
        curve=model.curve(ids, offloaded_ids, prefetch, prediction.reads_checkpoints,
                          prediction.recomputes_ahead,
                          read_last_segment=prediction.reads_last_segment),
        reads_checkpoints=prediction.reads_checkpoints,
        recomputes_ahead=prediction.recomputes_ahead,
        reads_last_segment=prediction.reads_last_segment,
        # Not under XLA (which drops control inputs), nor where TensorFlow's own CPU
        # convolution gradients run pairwise one after the other: their control inputs
        # point from a filter gradient to the input gradient made before it, and a chain
        # beside those edges could close a cycle.
        orders_backward=(selection.order_backward and not environment.under_xla
                         and not serializes_conv_gradients
                         and graph.largest_bytes >= large_bytes),
        large_bytes=large_bytes,
        serializes_conv_gradients=serializes_conv_gradients,
        forward_reads=ForwardReads(graph, set(ids), offloaded_ids, prediction.reads_checkpoints,
                                   segmentation.last_segment_tensors()
                                   if prediction.reads_last_segment else ()),
        deferred=frozenset(graph.deferred_tensors),
        recomputed_loops=frozenset(graph.ops[op] for op in graph.recomputed_loops()),
        loop_chunks=tuple((graph.ops[op], graph.loops[op].chunk)
                          for op in graph.recomputed_loops()))
    baseline = common["baseline"].device_peak_bytes
    if (prediction.device_peak_bytes > (1 - _MIN_PREDICTED_SAVING) * baseline
            and not environment.always_rewrite):
        return Plan(fallback=(
            f"memsave: strategy {strategy_name!r} is predicted to peak at "
            f"{prediction.device_peak_bytes / 2**20:.3g} MiB, not below tf.gradients' "
            f"{baseline / 2**20:.3g} MiB, so plain tf.gradients was used"),
            warn=explicit, **decided)
    # (only for a plan that may run: two more simulations where a loop moves the peak)
    decided["prediction_range"] = model.peak_range(
        ids, offloaded_ids, prefetch, problem.offload.flops_per_byte if offloaded_ids else None,
        **prediction.flags())
    try:
        parts = _parts_in_backward_order(region, segmentation, xs, [c.tensor for c in kept])
    except backward.NoBackwardOrder as why:
        return Plan(fallback=f"memsave: {why}, so plain tf.gradients answered the call",
                    warn=explicit, **decided)
    called = _call_read_by_a_kept_part(parts)
    if called is not None:
        return Plan(fallback=(
            f"memsave: {called.name}, made by a function call, is read by an op that is not "
            f"recomputed; differentiating that op alone, tf.gradients would also build a "
            f"SymbolicGradient of the call, which cannot run, so plain tf.gradients answered "
            f"the call"), warn=explicit, **decided)
    return Plan(parts=tuple(parts), **decided)


def _call_read_by_a_kept_part(parts):
    """A tensor made by a function call that a kept part reads, or None. tf.gradients
    asked for the gradient of such a tensor (an x of its call) still builds the call's
    gradient, as a SymbolicGradient op, which fails for a jit-compiled or stateful
    function; segments read their inputs through identities and are not affected."""
    return next((t for part in parts if part.kind == backward.KEPT for t in part.reads
                 if calls.is_call(t.op)), None)


def _offloaded(kept, problem):
    """Names of the checkpoints that wait in host memory: those that may (large enough,
    on another device than the host), but where a planner chose (Choice.offload not
    None), only those it chose."""
    options = problem.offload
    if options is None:
        return frozenset()
    accelerator = problem.offload_accelerator
    chosen = None
    if any(c.offload is not None for c in kept):
        chosen = {c.tensor.name for c in kept if c.offload}
    unknown_dim_size = problem.model.graph.unknown_dim_size
    return frozenset(c.tensor.name for c in kept
                     if offload_lib.may_offload(c.tensor, options, accelerator, unknown_dim_size)
                     and (chosen is None or c.tensor.name in chosen))


def _parts_in_backward_order(region, segmentation, xs, checkpoints):
    """The rewrite's parts (memsave.backward), each after every part sending gradient to
    what it needs, so each gradient function is called once with its whole gradient.
    Each segment's ops are those `segmentation` (the planner's, whose checkpoints are
    `checkpoints`) gives it.

    Raises:
      backward.NoBackwardOrder: where there is no such order.
    """
    step_graph = segmentation.graph

    def segment_of(group):
        head = LAST if group is None else step_graph.op_id[group[0].op]
        return [step_graph.ops[op] for op in segmentation.ops.get(head, ())]

    checkpoint_set = TensorSet(checkpoints)
    groups = {}
    for c in checkpoints:
        groups.setdefault(c.op, []).append(c)
    ordered_groups = [groups[op] for op in sorted(groups, key=region.position.__getitem__)]
    reads_of_xs = TensorSet(x for x in xs if x.dtype == tf.resource)
    parts = backward.parts_of(region, region.ys, checkpoint_set, ordered_groups,
                              step_graph.op_id.__getitem__,
                              skip_kept=lambda op: reads_one_of(op, reads_of_xs),
                              segment_of=segment_of)
    return backward.backward_order(
        parts, lambda t: region.is_x(t) or reads_one_of(t.op, reads_of_xs))


def reads_one_of(op, handles):
    """Whether `op` reads the value of a variable whose handle is in `handles`: its
    gradient is that variable's, summed into the result without a gradient call."""
    return op.type == "ReadVariableOp" and op.inputs[0] in handles


# -- the checkpoints ---------------------------------------------------------------------

def _select_checkpoints(choices, region):
    """Keeps region tensors, dropping xs, ys and tensors that cannot be segment ends."""
    kept, dropped, seen = [], [], TensorSet()
    for choice in _as_choices(choices, region):
        t = choice.tensor
        if t in seen:
            continue
        seen.add(t)
        why = None
        if region.is_x(t):
            why = "it is one of the xs"
        elif region.is_y(t):
            why = "it is one of the ys"
        elif t.op not in region:
            why = region.why_outside(t.op)
            if why == NOT_RECOMPUTABLE:
                dropped.append((t.name, why))
                continue
        if why is None:
            kept.append(choice)
            continue
        dropped.append((t.name, why))
        warnings.warn(f"memsave: checkpoint {t.name} dropped: {why}", MemsaveWarning,
                      stacklevel=6)
    kept.sort(key=lambda c: region.position[c.tensor.op])
    return kept, dropped


def _as_choices(choices, region):
    """A strategy's result as Choices; custom strategies may also return plain tensors."""
    graph = region.ys[0].graph
    allowed = ("a strategy returns a list of memsave.strategies.Choice(tensor, reason) or of "
               "graph tensors of the graph being differentiated")
    if isinstance(choices, (tf.Tensor, str)) or not hasattr(choices, "__iter__"):
        raise MemsaveError(f"the checkpoint strategy returned a {type(choices).__name__}; {allowed}")
    result = []
    for i, item in enumerate(choices):
        t = item.tensor if isinstance(item, Choice) else item
        if not isinstance(t, tf.Tensor) or _tf_private.is_eager_tensor(t):
            raise MemsaveError(f"the checkpoint strategy returned a {type(t).__name__} at position "
                               f"{i}; {allowed}")
        if t.graph is not graph:
            raise MemsaveError(f"the checkpoint strategy returned {t.name}, a tensor of another "
                               f"graph, at position {i}; {allowed}")
        result.append(item if isinstance(item, Choice) else Choice(t, "chosen by a custom strategy"))
    return result


def _with_shared_tensors(kept, graph, region):
    """Adds the tensors ops that are not recomputed read (memsave.backward: a segment
    ends there, so the op's gradient is taken once, with its whole gradient) and those
    several segments would recompute (memsave.planner.segments).

    Returns:
      (the kept Choices in forward order, the Segmentation of all of them, whose
      segments the builder copies).
    """
    if not kept:
        return kept, None
    segmentation = Segmentation(graph, [graph.id_of(c.tensor) for c in kept])
    added = [Choice(graph.tensors[t], _Y_READ_BY_REGION if graph.is_y[t] else _READ_BY_KEPT_OP)
             for t in segmentation.forced]
    added += [Choice(graph.tensors[t], _Y_OF_A_SHARED_OP if graph.is_y[t] else
                     "read by several segments: kept so it is recomputed once")
              for t in segmentation.shared]
    if not added:
        return kept, segmentation
    logger.debug("memsave: keeping %d tensors read by ops that are not recomputed and %d read "
                 "by several segments", len(segmentation.forced), len(segmentation.shared))
    kept = kept + added
    kept.sort(key=lambda c: region.position[c.tensor.op])
    return kept, segmentation


_READ_BY_KEPT_OP = ("read by an op that is not recomputed (control flow, a stateful op): a "
                    "segment ends there, so that op's gradient is taken once")
_Y_READ_BY_REGION = ("one of the ys, read by recomputed ops: a segment ends there, so the ops "
                     "making it are differentiated once")
_Y_OF_A_SHARED_OP = ("one of the ys, made by an op whose other outputs other segments read: a "
                     "segment ends at all of them, so the op is differentiated once")


def _no_checkpoints_message(strategy_name, region):
    if strategy_name == "collection":
        hint = ("mark tensors with memsave.mark_checkpoint(t), pass checkpoints='memory', "
                "or pass a list of tensors")
    else:
        hint = "pass a list of tensors on the path from xs to ys, or checkpoints='memory'"
    return (f"memsave: strategy {strategy_name!r} chose no usable checkpoints in a region of "
            f"{len(region)} ops, so nothing can be saved and plain tf.gradients was used; {hint}")

