"""The checkpointed gradient rewrite (SPEC, "The rewrite, in steps").

1. forward region (memsave.region);  2. checkpoints (memsave.strategies),
   plus the tensors several segments would read (memsave.segments), so no op
   is recomputed twice;
3. boundaries: every segment reads its checkpoints through its own
   identity, which its `tf.gradients` call treats as an x and a stop, so the
   gradient of a segment stops at them (an identity, not a `stop_gradient`:
   the gradients memsave returns stay differentiable, e.g. for a gradient
   penalty or a Hessian-vector product);
4. the last segment (checkpoints -> ys) is copied and differentiated;
5. earlier segments, in reverse topological order, are copied and
   differentiated with the accumulated gradient of their checkpoints; their
   gradient ops read small tensors (and, where the plan says so, the checkpoint
   the segment ends at) as the forward pass made them, so the copies that would
   only remake them never run (memsave.planner.segments);
6. copies wait, through control inputs on the segment's identities (on a copy
   itself only where it reads none), for what must come first (the forward
   ys, or the gradient of their checkpoints), or they would run during the
   forward pass and nothing would be saved; weight gradients larger than what
   they read (StepGraph.deferred) wait for the last segment's backward pass, so
   they are not held through it;
7. gradients of the xs are summed, kept sparse where possible; a variable
   read's gradient is its variable's.

Tensors that depend on the xs but cannot be recomputed (variable reads, random
draws, control flow: see memsave.region) are read by the copies through a
segment-local identity too. The ops that make them are differentiated as they
are, each once, with the whole gradient of their outputs, between the segments
(memsave.backward orders the parts; what such an op reads from the region is a
checkpoint): every gradient function is called once, as tf.gradients calls it.
Variable reads of the xs need no call: their gradients are the variables'. Keeping
every segment's inputs local also keeps each per-segment `tf.gradients` call
proportional to its segment, not to the whole graph.
"""

import contextlib
import functools
import gc
import logging
import os
import threading
import warnings

import tensorflow as tf

from memsave import aggregate, backward, inputs, planner
from memsave import offload as offload_lib
from memsave import report as report_lib
from memsave.errors import DEBUG_HINT, MemsaveError, MemsaveTypeError, MemsaveWarning
from memsave.graph import _tf_private
from memsave.graph.reroute import reroute_ts
from memsave.graph.select import TensorMap, TensorSet, get_ops_on_cycles, tensor_key
from memsave.graph.transform import copy_with_input_replacements
from memsave.planner.segments import ForwardReads, Segmentation
from memsave.region import NOT_RECOMPUTABLE, ForwardRegion, estimated_bytes
from memsave.strategies import Choice
from memsave.strategies.planned import PLAIN

logger = logging.getLogger(__name__)

# The real tf.gradients, captured at import: memsave.patch() may replace the public
# names, and the per-segment calls must still reach TensorFlow's own implementation.
_tf_gradients = tf.compat.v1.gradients

# memsave builds graphs; it must never be transpiled by AutoGraph when called from a
# tf.function (that is slow, and would turn its Python `if`s into graph conditionals).
_graph_code = tf.autograph.experimental.do_not_convert

# `checkpoints` when the caller did not pass it: 'collection', but a fallback to plain
# tf.gradients is then not worth a warning.
_DEFAULT = type("_DefaultCheckpoints", (), {"__repr__": lambda self: "'collection'"})()

# A plan must predict at least this much less than tf.gradients to be used.
_MIN_PREDICTED_SAVING = 0.02

_switches = threading.local()


ALWAYS_REWRITE_ENV = "MEMSAVE_ALWAYS_REWRITE"


def _always_rewrite():
    setting = getattr(_switches, "always_rewrite", None)
    if setting is None:
        return os.environ.get(ALWAYS_REWRITE_ENV) == "1"
    return setting


@contextlib.contextmanager
def always_rewrite(enabled=True):
    """Within this context, build the rewrite even where the memory model predicts no
    saving (normally memsave then uses plain tf.gradients). For tests and debugging
    of the rewrite on small graphs; restores the previous setting on exit. Outside
    any such context, the environment variable MEMSAVE_ALWAYS_REWRITE=1 does the same
    (for child processes).
    """
    previous = getattr(_switches, "always_rewrite", None)
    _switches.always_rewrite = enabled
    try:
        yield
    finally:
        _switches.always_rewrite = previous


_collector_lock = threading.Lock()
_collector_pauses = [0, False]  # [calls in progress, whether the collector was on at the first]


def _cycle_collector_paused(build):
    """Runs `build` with Python's cycle collector off, restoring it after the last
    concurrent call returns.

    Planning and rewriting a 20k-op step allocates ~10^5 small containers that all
    live on (the plan's lists, the new ops), and each allocation burst makes the
    collector walk every Python object of the graph again: about 10% of the build
    time, and nothing to collect (measured: no cycles freed at the end of a call).
    """
    @functools.wraps(build)
    def paused(*args, **kwargs):
        with _collector_lock:
            if _collector_pauses[0] == 0:
                _collector_pauses[1] = gc.isenabled()
                gc.disable()
            _collector_pauses[0] += 1
        try:
            return build(*args, **kwargs)
        finally:
            with _collector_lock:
                _collector_pauses[0] -= 1
                if _collector_pauses[0] == 0 and _collector_pauses[1]:
                    gc.enable()
    return paused


_PASSED_THROUGH = ("gate_gradients", "aggregation_method", "colocate_gradients_with_ops")


@_graph_code
@_cycle_collector_paused
def gradients(ys, xs, grad_ys=None, checkpoints=_DEFAULT, offload=False, **kwargs):
    """Gradients of `ys` with respect to `xs`, keeping only checkpoint activations.

    A drop-in replacement for `tf.gradients`, for tf.compat.v1 graphs and
    tf.function bodies: every call tf.gradients answers, memsave answers the same
    (the same structure, dtypes and values). Where it can save nothing (no y
    depends on an x, integer ys, tensors captured from an enclosing graph, ...)
    plain tf.gradients answers, and `last_report()` says why. Python's cycle
    collector is paused during the call and restored after it.

    Args:
      ys: a tensor or list of tensors to differentiate.
      xs: a tensor, variable, or list of them.
      grad_ys: optional initial gradients, one per y.
      checkpoints: a list of tensors (or tensor names) to keep, a strategy
        name ('collection', 'memory', 'speed') or a strategy callable.
      offload: keep checkpoints in host memory between the forward and the
        backward pass (memsave.offload): False (default), True (the host of
        each checkpoint's device), a device string, or memsave.Offload(...).
      **kwargs: as for tf.gradients (gate_gradients, aggregation_method,
        colocate_gradients_with_ops (default True, as tf.gradients),
        stop_gradients, unconnected_gradients, name).
    Returns:
      A list with one gradient per x (None where x does not affect ys, unless
      unconnected_gradients='zero').
    Raises:
      MemsaveError: for bad input, before anything is added to the graph; where
        tf.gradients would raise a TypeError, AttributeError or RuntimeError, the
        MemsaveError is one too.
    """
    options = _Options(kwargs)
    call = inputs.normalise_call(ys, xs, grad_ys, kwargs.get("stop_gradients"))
    strategy, strategy_name = inputs.resolve_strategy(
        "collection" if checkpoints is _DEFAULT else checkpoints, call.graph)
    offload = _offload_of(offload, strategy)
    explicit = isinstance(checkpoints, (list, tuple))
    if call.delegate:
        return _plain_gradients(_plain_report(strategy_name, call.delegate), explicit,
                                ys, xs, grad_ys, options)
    options.stop = TensorSet(call.stop)
    with call.graph.as_default():
        region = ForwardRegion.build(call.ys, call.xs)
        if not any(region.is_connected(x) for x in call.xs):
            return _plain_gradients(_plain_report(strategy_name, _UNCONNECTED, region), explicit,
                                    ys, xs, grad_ys, options)
        # Under gate_gradients a weight's gradient is grouped with its input's: none can
        # be made last, and the memory model must not plan as if it were.
        region.cache[planner.NO_DEFERRAL] = bool(options.passed.get("gate_gradients"))
        offloader = _offloader(offload, region, call.graph)
        kept, dropped = _select_checkpoints(strategy(region), region)
        kept = _with_shared_tensors(kept, region)
        offloader.follow(kept)
        report = _report(strategy_name, region, kept, dropped, offloader)
        if report.fallback:
            return _plain_gradients(report, explicit and not region.cache.get(PLAIN),
                                    ys, xs, grad_ys, options)
        checkpoints = [c.tensor for c in kept]
        try:
            parts = _parts_in_backward_order(call, region, checkpoints)
        except backward.NoBackwardOrder as why:
            report.fallback = f"memsave: {why}, so plain tf.gradients answered the call"
            return _plain_gradients(report, explicit, ys, xs, grad_ys, options)
        made_before = len(call.graph.get_operations())
        with tf.name_scope(options.name):
            result = _Rewrite(call.ys, call.xs, call.grad_ys, region, checkpoints, parts,
                              options, report, offloader).run()
        _check_acyclic(call.graph.get_operations()[made_before:])
    report_lib.record(report)
    return result


def _check_acyclic(new_ops):
    """Raises where the rewrite's ops (`new_ops`) close a cycle, which TensorFlow would
    only refuse when the step runs; their control inputs are removed first, so what
    is left in the graph is never run and never fails.

    Raises:
      MemsaveError: naming ops on the cycle.
    """
    on_cycles = get_ops_on_cycles(new_ops)
    if not on_cycles:
        return
    for op in new_ops:
        _tf_private.remove_control_inputs(op)
    names = ", ".join(op.name for op in on_cycles[:6]) + (" ..." if len(on_cycles) > 6 else "")
    raise MemsaveError(
        f"the rewrite would close a cycle of {len(on_cycles)} ops ({names}), so no gradients "
        "were returned; this is a bug in memsave, please report it with the model. Meanwhile, "
        "another strategy (e.g. checkpoints='memory' or a list) or tf.gradients avoids it",
        hint=DEBUG_HINT)


def _parts_in_backward_order(call, region, checkpoints):
    """The rewrite's parts (memsave.backward), each after every part sending gradient to
    what it needs, so each gradient function is called once with its whole gradient.
    Adds nothing to the graph.

    Raises:
      backward.NoBackwardOrder: where there is no such order.
    """
    step_graph = planner.model_of(region).graph
    checkpoint_set = TensorSet(checkpoints)
    groups = {}
    for c in checkpoints:
        groups.setdefault(c.op, []).append(c)
    ordered_groups = [groups[op] for op in sorted(groups, key=region.position.__getitem__)]
    reads_of_xs = _reads_of_variables(call.xs)
    parts = backward.parts_of(region, call.ys, checkpoint_set, ordered_groups,
                              step_graph.op_id.__getitem__,
                              skip_kept=lambda op: _reads_one_of(op, reads_of_xs))
    return backward.backward_order(
        parts, lambda t: region.is_x(t) or _reads_one_of(t.op, reads_of_xs))


def _reads_of_variables(xs):
    """The variable handles among `xs` (a TensorSet)."""
    return TensorSet(x for x in xs if x.dtype == tf.resource)


def _reads_one_of(op, handles):
    """Whether `op` reads the value of a variable whose handle is in `handles`: its
    gradient is that variable's, summed into the result without a gradient call."""
    return op.type == "ReadVariableOp" and op.inputs[0] in handles


_UNCONNECTED = "none of the ys depends on any of the xs"


def _plain_report(strategy_name, reason, region=None):
    """The report of a call plain tf.gradients answers because of `reason`."""
    return report_lib.RewriteReport(
        strategy=strategy_name, region_ops=0 if region is None else len(region),
        fallback=f"memsave: {reason}, so plain tf.gradients answered the call")


def _plain_gradients(report, warn, ys, xs, grad_ys, options):
    """Plain tf.gradients on the caller's own arguments, saying why: a warning only
    where the caller asked for something memsave could not honour (a checkpoint
    list), an INFO log otherwise."""
    if warn:
        warnings.warn(report.fallback, MemsaveWarning, stacklevel=4)
    else:
        logger.info("%s", report.fallback)
    result = _tf_gradients(ys, xs, grad_ys=grad_ys, **options.plain)
    report_lib.record(report)
    return result


@_graph_code
def gradients_speed(ys, xs, grad_ys=None, **kwargs):
    """`gradients` with checkpoints='speed' (keep outputs of matmuls/convolutions)."""
    return gradients(ys, xs, grad_ys, checkpoints="speed", **kwargs)


@_graph_code
def gradients_memory(ys, xs, grad_ys=None, **kwargs):
    """`gradients` with checkpoints='memory' (automatic, about sqrt(N) narrow cuts)."""
    return gradients(ys, xs, grad_ys, checkpoints="memory", **kwargs)


@_graph_code
def gradients_collection(ys, xs, grad_ys=None, **kwargs):
    """`gradients` with checkpoints='collection' (tensors marked with mark_checkpoint)."""
    return gradients(ys, xs, grad_ys, checkpoints="collection", **kwargs)


@_graph_code
@_cycle_collector_paused
def plan(ys, xs, checkpoints="collection", unknown_dim_size=None, offload=False):
    """What `gradients` would keep, without adding anything to the graph.

    Args:
      ys, xs, checkpoints: as for `gradients`.
      unknown_dim_size: the size the memory model assumes for unknown dimensions
        (e.g. the batch fed to a placeholder of shape [None, ...]); default 1. The
        report's `unknown_dims` says how many tensors that concerns.
      offload: as for `gradients`: offloaded checkpoints count as host memory
        (`predicted_host_bytes`), not device memory, between their forward readers
        and their copy back.
    Returns:
      A RewriteReport with the region, the checkpoints and the predicted peaks
      (no segments); where memsave.gradients would leave the call to plain
      tf.gradients, its `fallback` says why.
    """
    call = inputs.normalise_call(ys, xs)
    strategy, strategy_name = inputs.resolve_strategy(checkpoints, call.graph)
    offload = _offload_of(offload, strategy)
    if call.delegate:
        return _plain_report(strategy_name, call.delegate)
    region = ForwardRegion.build(call.ys, call.xs)
    if not any(region.is_connected(x) for x in call.xs):
        return _plain_report(strategy_name, _UNCONNECTED, region)
    region.cache[planner.UNKNOWN_DIM_SIZE] = planner.check_unknown_dim_size(unknown_dim_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemsaveWarning)
        offloader = _offloader(offload, region, call.graph)
        kept, dropped = _select_checkpoints(strategy(region), region)
    kept = _with_shared_tensors(kept, region)
    offloader.follow(kept)
    return _report(strategy_name, region, kept, dropped, offloader)


def _offload_of(offload, strategy):
    """The call's offload setting (an Offload or None): its own `offload=` or the
    strategy's (memsave.budget(..., offload=)).

    Raises:
      MemsaveError: when the two differ.
    """
    offload = offload_lib.normalise(offload)
    planned = getattr(strategy, "offload", None)
    if planned is None or offload == planned:
        return planned or offload
    if offload is not None:
        raise MemsaveError(f"offload is given twice, as {offload!r} and as {planned!r} in "
                           f"{strategy!r}; give it in one place")
    return planned


def _offloader(offload, region, graph):
    """The call's Offloader, where planners (memsave.budget) find it too."""
    offloader = offload_lib.Offloader(offload, _tf_private.in_xla_context(graph))
    region.cache[offload_lib.OFFLOADER] = offloader
    return offloader


def _report(strategy_name, region, kept, dropped, offloader):
    """The RewriteReport of a plan, with the memory model's predictions.

    Sets `fallback` when there is no plan (nothing usable was chosen, or a budget
    that plain tf.gradients meets) or it is predicted to need no less than plain
    tf.gradients. Checkpoints `offloader` offloads count as host memory.
    """
    model = planner.model_of(region)
    baseline = model.baseline(allocator=True)
    report = report_lib.RewriteReport(
        strategy=strategy_name, region_ops=len(region),
        checkpoints=[report_lib.CheckpointInfo.of(c.tensor, c.reason) for c in kept],
        dropped=dropped,
        not_recomputable=[(op.name, why) for op, why in region.kept_ops],
        baseline_peak_bytes=baseline.device_peak_bytes, baseline_peak_at=baseline.device_peak_at,
        resident_bytes=baseline.resident_bytes, unknown_dims=len(model.graph.unknown_dims),
        unknown_dim_size=model.graph.unknown_dim_size)
    if not kept:
        report.predicted_peak_bytes = baseline.device_peak_bytes
        report.predicted_live_bytes = baseline.peak_bytes
        report.peak_at = baseline.device_peak_at
        report.fallback = region.cache.get(PLAIN) or _no_checkpoints_message(strategy_name, region)
        return report
    graph = model.graph
    offloaded = []
    for c, info in zip(kept, report.checkpoints):
        info.offloaded = offloader.applies_to(c.tensor)
        if info.offloaded:
            offloaded.append(graph.id_of(c.tensor))
    prediction = _final_prediction(model, region, [graph.id_of(c.tensor) for c in kept],
                                   offloaded, offloader.options)
    report.reads_checkpoints = prediction.reads_checkpoints
    report.recomputes_ahead = prediction.recomputes_ahead
    # Not under XLA (which drops control inputs), nor where TensorFlow's own CPU
    # convolution gradients run one after the other (_Rewrite.serialize_conv_gradients:
    # their control inputs point from a filter gradient to the input gradient made
    # before it, and a chain in the order of making would close a cycle).
    report.orders_backward = (bool(region.cache.get(planner.ORDER_BACKWARD))
                              and not _tf_private.in_xla_context(region.ys[0].graph)
                              and not graph.conv_threads)
    report.predicted_peak_bytes = prediction.device_peak_bytes
    report.predicted_live_bytes = prediction.peak_bytes
    report.predicted_host_bytes = prediction.host_bytes
    report.offload_moved_bytes = prediction.moved_bytes  # (the rewrite counts what it moves)
    report.transfer_flops = prediction.transfer_flops
    report.peak_at = prediction.device_peak_at
    report.recompute_flops = prediction.recompute_flops
    report.deferred_gradients = prediction.deferred_gradients
    report.predicted_segments = prediction.segments
    report.predicted_recomputed_ops = prediction.recomputed_ops
    report.forward_flops = prediction.forward_flops
    if (prediction.device_peak_bytes > (1 - _MIN_PREDICTED_SAVING) * baseline.device_peak_bytes
            and not _always_rewrite()):
        report.fallback = (
            f"memsave: strategy {strategy_name!r} is predicted to peak at "
            f"{prediction.device_peak_bytes / 2**20:.3g} MB, not below tf.gradients' "
            f"{baseline.device_peak_bytes / 2**20:.3g} MB, so plain tf.gradients was used")
    return report


# A plan reads its checkpoints, or recomputes ahead, where the strategy did not decide
# and that raises its predicted peak by at most this much.
_FREE_PEAK_TOLERANCE = 0.01


def _final_prediction(model, region, checkpoints, offloaded, options):
    """The prediction of the chosen plan: whether its segments read their checkpoints
    (_reading_or_recomputing), then whether they recompute ahead (_ahead_or_not)."""
    prediction = _reading_or_recomputing(model, region, checkpoints, offloaded, options)
    return _ahead_or_not(model, region, checkpoints, offloaded, prediction)


def _ahead_or_not(model, region, checkpoints, offloaded, prediction):
    """`prediction`, or that of the same plan recomputing ahead (MemoryModel.predict's
    recompute_ahead: each segment's recomputation runs beside the backward pass of the
    segment after it, so it leaves the critical path where the executor runs ops side
    by side): where the strategy chose so (a budget, where it fits), or, where it did
    not choose, if the predicted peak stays within _FREE_PEAK_TOLERANCE.

    Not with offloaded checkpoints (their copies back are timed by the segments'
    triggers) nor under XLA (planner.may_recompute_ahead)."""
    chosen = region.cache.get(planner.RECOMPUTE_AHEAD)
    if chosen is False or offloaded or not planner.may_recompute_ahead(region):
        return prediction
    within = 1 + _FREE_PEAK_TOLERANCE
    reads = prediction.reads_checkpoints
    if not chosen:  # (live tensors first: the allocator's replay only if they qualify)
        ahead = model.predict(checkpoints, recompute_ahead=True, read_checkpoints=reads)
        if ahead.peak_bytes > prediction.peak_bytes * within:
            return prediction
    ahead = model.predict(checkpoints, allocator=True, recompute_ahead=True,
                          read_checkpoints=reads)
    if chosen or ahead.device_peak_bytes <= prediction.device_peak_bytes * within:
        return ahead
    return prediction


def _reading_or_recomputing(model, region, checkpoints, offloaded, options):
    """The prediction of the chosen plan, its segments reading or recomputing the
    checkpoint each ends at (Prediction.reads_checkpoints).

    Its segments read their checkpoints as the forward pass made them where they may
    (planner.may_read_checkpoints) and the strategy chose so (a budget searches both
    kinds of plan), or, where it did not choose, if that recomputes less and keeps the
    predicted peak within _FREE_PEAK_TOLERANCE of recomputing them: reading
    holds each checkpoint through the later segment's backward pass, and a segment
    ending at a ReLU then runs nothing."""
    extra = (options.prefetch, options.flops_per_byte) if offloaded else ()
    chosen = region.cache.get(planner.READ_CHECKPOINTS)
    recomputing = model.predict(checkpoints, offloaded, *extra, allocator=True)
    if chosen is False or not planner.may_read_checkpoints(region):
        return recomputing
    graph = model.graph
    if not chosen and not any(c in graph.grad_reads[graph.producer[c]] for c in checkpoints):
        return recomputing  # no checkpoint's own gradient reads it: nothing to gain
    within = 1 + _FREE_PEAK_TOLERANCE
    if not chosen:  # (live tensors first: the allocator's replay only if they qualify)
        reading = model.predict(checkpoints, offloaded, *extra, read_checkpoints=True)
        if (reading.cost_flops >= recomputing.cost_flops
                or reading.peak_bytes > recomputing.peak_bytes * within):
            return recomputing
    reading = model.predict(checkpoints, offloaded, *extra, allocator=True,
                            read_checkpoints=True)
    if chosen or reading.device_peak_bytes <= recomputing.device_peak_bytes * within:
        return reading
    return recomputing


class _Options:
    """The tf.gradients keyword arguments, split by how the rewrite uses them."""

    def __init__(self, kwargs):
        unknown = set(kwargs) - set(_PASSED_THROUGH) - {"stop_gradients", "unconnected_gradients",
                                                        "name"}
        if unknown:
            # (tf.gradients: a TypeError, as for any unexpected keyword)
            raise MemsaveTypeError(f"unexpected keyword argument(s) {sorted(unknown)}; "
                                   f"memsave.gradients accepts tf.gradients' own: "
                                   f"{', '.join(_PASSED_THROUGH)}, stop_gradients, "
                                   "unconnected_gradients, name")
        self.passed = {k: kwargs[k] for k in _PASSED_THROUGH if k in kwargs}
        # tf.gradients (TF2) always colocates; tf.compat.v1.gradients' callers pass False.
        self.passed.setdefault("colocate_gradients_with_ops", True)
        self.colocate = bool(self.passed["colocate_gradients_with_ops"])
        unconnected = kwargs.get("unconnected_gradients", tf.UnconnectedGradients.NONE)
        try:
            self.unconnected = tf.UnconnectedGradients(unconnected)
        except ValueError as error:
            # (tf.gradients' own words first: code written around it matches them)
            raise MemsaveError(f"Unknown value for unconnected_gradients: {unconnected!r}; "
                               "expected 'none' or 'zero' (tf.UnconnectedGradients.NONE or "
                               ".ZERO)") from error
        self.name = kwargs.get("name") or "memsave"
        # Everything, for a call answered by plain tf.gradients.
        self.plain = dict(self.passed, unconnected_gradients=self.unconnected,
                          name=kwargs.get("name") or "gradients")
        if kwargs.get("stop_gradients") is not None:
            self.plain["stop_gradients"] = kwargs["stop_gradients"]
        self.stop = TensorSet()


def _select_checkpoints(choices, region):
    """Step 2: keeps region tensors, dropping xs, ys and tensors that cannot be segment ends."""
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
                          stacklevel=4)
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


def _with_shared_tensors(kept, region):
    """Step 2b: adds the tensors ops that are not recomputed read (memsave.backward: a
    segment ends there, so the op's gradient is taken once, with its whole gradient) and
    those several segments would recompute (memsave.planner.segments)."""
    if not kept:
        return kept
    graph = planner.model_of(region).graph
    segmentation = Segmentation(graph, [graph.id_of(c.tensor) for c in kept])
    added = [Choice(graph.tensors[t], _Y_READ_BY_REGION if graph.is_y[t] else _READ_BY_KEPT_OP)
             for t in segmentation.forced]
    added += [Choice(graph.tensors[t], "read by several segments: kept so it is recomputed "
                     "once") for t in segmentation.shared]
    if not added:
        return kept
    logger.debug("memsave: keeping %d tensors read by ops that are not recomputed and %d read "
                 "by several segments", len(segmentation.forced), len(segmentation.shared))
    kept = kept + added
    kept.sort(key=lambda c: region.position[c.tensor.op])
    return kept


_READ_BY_KEPT_OP = ("read by an op that is not recomputed (control flow, a stateful op): a "
                    "segment ends there, so that op's gradient is taken once")
_Y_READ_BY_REGION = ("one of the ys, read by recomputed ops: a segment ends there, so the ops "
                     "making it are differentiated once")


def _no_checkpoints_message(strategy_name, region):
    if strategy_name == "collection":
        hint = ("mark tensors with memsave.mark_checkpoint(t), pass checkpoints='memory', "
                "or pass a list of tensors")
    else:
        hint = "pass a list of tensors on the path from xs to ys, or checkpoints='memory'"
    return (f"memsave: strategy {strategy_name!r} chose no usable checkpoints in a region of "
            f"{len(region)} ops, so nothing can be saved and plain tf.gradients was used; {hint}")


class _Rewrite:
    """One rewrite: the segments, and the gradient contributions between them."""

    def __init__(self, ys, xs, grad_ys, region, checkpoints, parts, options, report, offloader):
        self.ys, self.xs = ys, xs
        self.parts = parts  # (memsave.backward, in backward order)
        # grad_ys may be Python numbers or numpy arrays (checked by memsave.inputs).
        self.grad_ys = None if grad_ys is None else [
            None if g is None else tf.convert_to_tensor(g, dtype=y.dtype.base_dtype)
            for g, y in zip(grad_ys, ys)]
        self.region = region
        self.checkpoints = TensorSet(checkpoints)
        self.options = options
        self.report = report
        self.pending = TensorMap()  # tensor -> list of gradient contributions
        self.totals = TensorMap()  # an x made from other xs -> its whole gradient
        # TensorFlow's own CPU convolution gradients each allocate a ~30 MiB im2col
        # buffer; run the two of one convolution one after the other (as the memory
        # model assumes for the rewrite), not side by side.
        self.serialize_conv_gradients = planner.model_of(region).graph.conv_threads > 0
        # Built for XLA (tf.function(jit_compile=True), Keras jit_compile): see _xla_gate.
        self.under_xla = _tf_private.in_xla_context(ys[0].graph)
        self.offloader = offloader
        self.triggers = []  # each segment's trigger ops, in the order the backward runs them
        self.trigger_tensors = []  # and one tensor of each (under XLA, the gate's)
        # Each segment's copies wait for the previous segment's trigger, not their own
        # (planner: MemoryModel.predict's recompute_ahead).
        self.ahead = report.recomputes_ahead
        # Weight gradients made after the last segment (StepGraph.deferred; none under
        # gate_gradients): per segment, the op sets that make them, and the segment's
        # other gradients.
        self.step_graph = planner.model_of(region).graph
        self.defer = bool(self.step_graph.deferred)
        # Which tensors the segments' gradients read from the forward pass (as the
        # memory model simulates the plan).
        ids = [self.step_graph.id_of(c) for c in self.checkpoints]
        self.reads_forward = ForwardReads(self.step_graph, set(ids), [
            tid for tid, c in zip(ids, self.checkpoints) if offloader.applies_to(c)],
            report.reads_checkpoints)
        self.deferred_cones, self.other_gradients = [], []
        # Each segment's large gradient ops one after another (report.orders_backward).
        self.order_backward = report.orders_backward

    def run(self):
        self._seed_ys_outside_the_last_segment()
        for part in self.parts:
            if part.kind == backward.KEPT:
                self._kept_part(part)
            elif part.is_last_segment:
                self._last_segment(part.ops)
            else:
                self._earlier_segment(part.checkpoint_group, part.ops)
        self._defer_weight_gradients()
        result = self._gradients_of_xs()
        self.report.offload_moved_bytes = self.offloader.moved_bytes
        return result

    # -- steps 4 and 5 -----------------------------------------------------------
    def _seed_ys_outside_the_last_segment(self):
        """The gradients of the ys the last segment does not end at (made by an op that is
        not recomputed, xs, and checkpoints) start as their grad_ys."""
        grad_ys = self.grad_ys or [None] * len(self.ys)
        for y, g in zip(self.ys, grad_ys):
            if (y.op not in self.region or y in self.checkpoints) and self.region.depends_on_xs(y):
                self._add(y, g if g is not None else tf.ones_like(y))

    def _last_segment(self, ops):
        grad_ys = self.grad_ys or [None] * len(self.ys)
        seg_ys, seg_grads, seen = [], [], TensorSet()
        for y, g in zip(self.ys, grad_ys):
            if y.op not in self.region or y in self.checkpoints:
                continue
            # A y that an op that is not recomputed reads gets that op's gradient too
            # (once, however often the y is listed).
            from_kept = [] if y in seen else self.pending_of(y)
            seen.add(y)
            if from_kept:
                g = self._summed(y, [g if g is not None else tf.ones_like(y)] + from_kept)
            seg_ys.append(y)
            seg_grads.append(g)
        if all(g is None for g in seg_grads):
            seg_grads = None
        else:
            seg_grads = [g if g is not None else tf.ones_like(y) for y, g in zip(seg_ys, seg_grads)]
        self._segment(seg_ys, seg_grads, [y.op for y in self.ys], seg_ys[0], "last_segment", ops)

    def _earlier_segment(self, group, ops):
        seg_ys, seg_grads = [], []
        for c in group:
            d_c = self._summed(c, self.pending_of(c))
            if d_c is not None and c not in self.options.stop:
                seg_ys.append(c)
                seg_grads.append(d_c)
        if seg_ys:
            self._segment(seg_ys, seg_grads, [g.op for g in seg_grads], seg_grads[0],
                          f"segment_{self.region.position[group[0].op]}",
                          ops if len(seg_ys) == len(group) else None)

    def _kept_part(self, part):
        """Differentiates ops that are not recomputed (memsave.backward), as they are,
        once, with the whole gradient of their outputs: every part sending gradient to
        them came before. An x among their outputs gets that whole gradient as its
        result (tf.gradients' answer for an x computed from other xs)."""
        ends_at, grads = [], []
        for t in part.ends_at:
            contributions = self.pending_of(t)
            if not contributions:
                continue
            if self.region.is_x(t):
                self.totals[t] = self._summed(t, contributions, keep_sparse=True)
            ends_at.append(t)
            grads.append(self._summed(t, contributions))
        if not ends_at:
            return
        # tf.gradients answers an x that its op makes beside outputs with a gradient with
        # zeros, not None: asked for here too, it answers the same.
        quiet_xs = [t for op in part.ops for t in op.outputs
                    if self.region.is_x(t) and t not in self.totals]
        with tf.name_scope("kept"):
            results = _tf_gradients(ends_at, part.reads + quiet_xs, grad_ys=grads,
                                    stop_gradients=part.reads + list(self.options.stop),
                                    **self.options.passed)
        for t, g in zip(part.reads, results):
            if g is not None:
                self._add(t, g)
        for t, g in zip(quiet_xs, results[len(part.reads):]):
            if g is not None:
                self.totals[t] = g

    def _segment(self, seg_ys, seg_grad_ys, trigger_ops, trigger, label, ops=None):
        """Copies the ops between `seg_ys` and the checkpoints and differentiates them.

        The copies wait for `trigger_ops` (control inputs), or where the plan recomputes
        ahead for the previous segment's, which the backward pass completes earlier, so
        they run beside that segment's backward pass; under XLA, which drops control
        inputs and merges equal computations, they read their inputs through a data
        dependency on `trigger` (or the previous segment's) as well (see `_xla_gate`).
        """
        if ops is None:
            ops = backward.segment_ops(seg_ys, self.region, self.checkpoints)
        local_inputs = backward.segment_reads(ops, self.region, self.checkpoints)
        self.triggers.append(trigger_ops)
        self.trigger_tensors.append(trigger)
        wait = -2 if self.ahead and len(self.triggers) > 1 else -1
        with tf.name_scope(label):
            gate = _xla_gate(self.trigger_tensors[wait]) if self.under_xla else None
            replacements = TensorMap((t, _local_input(self._source_of(t), gate))
                                     for t in local_inputs)
            copy = copy_with_input_replacements(ops, replacements, name_scope="recompute")
            for op in ops:
                # A copy runs where its original ran, and its gradient ops are colocated
                # with the original, as tf.gradients colocates them.
                _tf_private.colocate(copy.transformed(op), op)
            locals_ = [replacements[t] for t in local_inputs]
            self._order_after(copy, locals_, self.triggers[wait])
            copied_ys = [copy.transformed(y) for y in seg_ys]
            stop = [copy.transformed(t) for t in self.options.stop if copy.transformed(t) is not None]
            made_before = max(_tf_private.creation_index(t.op) for t in copied_ys + locals_)
            grads = _tf_gradients(copied_ys, locals_, grad_ys=seg_grad_ys,
                                  stop_gradients=stop + locals_, **self.options.passed)
            self._read_copies(ops, copy, made_before)
            self._read_from_forward(ops, copy, made_before, gate)
            deferred = self._deferred_cones(local_inputs, grads, made_before)
            if self.order_backward:
                _one_after_another(_large_ops_needed_by(
                    grads, made_before, deferred,
                    self.step_graph.largest_bytes // _LARGE_FRACTION))
            if gate is not None:
                # The gradients leave the segment materialised too: XLA would otherwise
                # fuse their last elementwise ops into the next segments' readers and keep
                # this segment's activations alive until then.
                grads = [_gated(g, gate) for g in grads]
            if self.serialize_conv_gradients:
                _serialize_conv_gradients(copy.ops, deferred)
        for t, g in zip(local_inputs, grads):
            if g is not None:
                self._add(t, g)
        running = _copies_that_run(copy.ops, made_before)
        self.report.segments.append(report_lib.SegmentInfo(
            ends_at=[y.name for y in seg_ys], copied_ops=len(copy), recomputed_ops=len(running),
            recomputed_bytes=sum(estimated_bytes(t) for op in running for t in op.outputs)))
        logger.debug("memsave: %s recomputes %d ops ending at %s", label, len(running),
                     [y.name for y in seg_ys])

    def _read_copies(self, ops, copy, made_before):
        """Gradient ops of the segment (made after `made_before`) that read a tensor of
        the forward pass the segment recomputes read its copy instead. Registered
        gradients read their own op's (the copy's) inputs and outputs; a custom
        gradient (`tf.custom_gradient`: Keras' swish, a user's) reads the tensors its
        closure holds, the forward pass's, which would otherwise stay alive from the
        forward pass to this segment's backward. Tensors ForwardReads names stay read
        from the forward pass (`_read_from_forward`)."""
        graph = self.step_graph
        for op in ops:
            for t in op.outputs:
                tid = graph.tensor_id.get((op, t.value_index))
                if tid is None or self.reads_forward(tid):
                    continue
                _reroute_readers(t, copy.transformed(t), made_before)

    def _read_from_forward(self, ops, copy, made_before, gate):
        """The segment's gradient ops (made after `made_before`) read the tensors that
        ForwardReads names as the forward pass made them, not from their
        copies; a copy that nothing else reads is never run (TensorFlow prunes it).
        Under XLA they read them through the segment's conditional, as the copies read
        their inputs (see `_xla_gate`)."""
        graph = self.step_graph
        for op in ops:
            for t in op.outputs:
                tid = graph.tensor_id.get((op, t.value_index))
                if tid is None or not self.reads_forward(tid):
                    continue
                copied = copy.transformed(t)
                if not _readers_made_after(copied, made_before):
                    continue
                source = t if gate is None else _gated(t, gate, name="forward")
                _reroute_readers(copied, source, made_before)

    def _deferred_cones(self, local_inputs, grads, made_before):
        """Records the ops that make this segment's deferred weight gradients (one set
        per gradient: the ops made by its tf.gradients call that nothing else reads) and
        the segment's other gradients; returns all the deferred ops."""
        cones = []
        if self.defer:
            deferred_tensors = self.step_graph.deferred_tensors
            tensor_id = self.step_graph.tensor_id
            # The segment's gradients are read later, by segments not yet built: no op
            # making one may wait, but the deferred one's own.
            returned = TensorSet(g for g in grads if isinstance(g, tf.Tensor))
            for t, g in zip(local_inputs, grads):
                if (isinstance(g, tf.Tensor)
                        and tensor_id.get((t.op, t.value_index)) in deferred_tensors):
                    cone = _exclusive_cone(g, made_before, returned)
                    if cone:
                        cones.append(cone)
        deferred = set().union(*cones)
        self.deferred_cones.append(cones)
        self.other_gradients.append(
            [g for g in grads if isinstance(g, tf.Tensor) and g.op not in deferred])
        return deferred

    def _defer_weight_gradients(self):
        """Makes the deferred weight gradients wait for the backward pass of the last
        segment built (the first in the forward pass): for its other gradients, or, where
        it has none, for what its own deferred gradients read. Through control inputs;
        under XLA, which drops those, by reading their inputs through a conditional on
        a value computed from all of those tensors (as copies wait, see `_xla_gate`)."""
        self.report.deferred_gradients = 0
        if not any(self.deferred_cones):
            return
        last_cones = self.deferred_cones[-1]
        trigger = self.other_gradients[-1] or list(TensorSet(
            t for cone in last_cones for op in cone for t in op.inputs if t.op not in cone))
        trigger = [t for t in trigger if _is_number(t.dtype)]
        if not trigger:
            return
        with tf.name_scope("deferred"):
            if self.under_xla:
                # (a sum of 1s: it exists only once every trigger does)
                wait, after = self._gate_inputs, tf.add_n([_xla_gate(t) for t in trigger])
            else:
                wait, after = _wait_for, [t.op for t in trigger]
            count = 0
            for cones in self.deferred_cones[:-1]:
                for cone in cones:
                    wait(cone, after)
                    count += 1
        self.report.deferred_gradients = count + len(last_cones)

    @staticmethod
    def _gate_inputs(cone, gate):
        """Under XLA: the ops of `cone` read the values they read from outside it through
        a conditional on `gate`, so XLA cannot run them before `gate` exists. Integer
        inputs are shapes and indices, which XLA needs as compile-time constants (a
        filter gradient's filter sizes): not gated."""
        gated = TensorMap()
        for op in cone:
            for index, t in enumerate(op.inputs):
                if t.op in cone or not (t.dtype.is_floating or t.dtype.is_complex):
                    continue
                if t not in gated:
                    gated[t] = _gated(t, gate, name="deferred_input")
                _tf_private.update_input(op, index, gated[t])

    def _source_of(self, t):
        """Where a segment reads input `t` from: an offloaded checkpoint's copy back, which
        leaves the host once the segment a prefetch distance earlier in the backward
        pass has its gradient (memsave.offload); `t` itself otherwise."""
        if t not in self.checkpoints or not self.offloader.applies_to(t):
            return t
        prefetch_from = max(len(self.triggers) - 1 - self.offloader.options.prefetch, 0)
        self.report.offloaded.append(t.name)
        return self.offloader.copy_back(t, self.triggers[prefetch_from])

    @staticmethod
    def _order_after(copy, locals_, trigger_ops):
        """Step 6: the copies wait for `trigger_ops`, through the segment's local inputs
        (`locals_`) where they read one: Grappler does not fuse a node with a control
        input of its own (a recomputed batch norm and its ReLU would run as two oneDNN
        kernels instead of one, as in the forward pass)."""
        _wait_for(set(copy.ops) | {t.op for t in locals_}, trigger_ops)

    # -- bookkeeping ---------------------------------------------------------------
    def _summed(self, t, contributions, keep_sparse=False):
        """The sum of `t`'s gradient contributions (dense, or sparse where all are), made
        where tf.gradients makes it: with t's op when colocating gradients with ops,
        under the caller's device scope otherwise."""
        placement = contextlib.nullcontext()
        if self.options.colocate:
            placement = tf.compat.v1.get_default_graph().colocate_with(t.op, ignore_existing=True)
        with placement:
            if keep_sparse:
                return aggregate.sum_keeping_sparse(contributions)
            return aggregate.sum_dense(contributions)

    def _add(self, t, gradient):
        contributions = self.pending.get(t)
        if contributions is None:
            self.pending[t] = contributions = []
        contributions.append(gradient)

    def pending_of(self, t):
        return self.pending.get(t, [])

    # -- step 7 ----------------------------------------------------------------------
    def _add_variable_reads(self, per_x):
        """Adds the gradient of each read of a variable that is one of the xs to that x's
        contributions, as tf.gradients does (a read's gradient is the variable's, sparse
        where every contribution is: a Keras Embedding reads its whole table and gathers
        rows). A training step reads thousands of variables: a gradient call per read
        would build an identity and a gradient op for each."""
        positions = TensorMap()
        for i, x in enumerate(self.xs):
            if x.dtype == tf.resource:
                positions[x] = positions.get(x, []) + [i]
        for t in self.pending.keys():
            if t.op.type != "ReadVariableOp" or t.op.inputs[0] not in positions:
                continue
            gradient = self._summed(t, self.pending_of(t), keep_sparse=True)
            for i in positions[t.op.inputs[0]]:
                per_x[i].append(gradient)

    def _gradients_of_xs(self):
        per_x = [list(self.pending_of(x)) for x in self.xs]
        self._add_variable_reads(per_x)
        result = [self.totals[x] if x in self.totals else self._summed(x, c, keep_sparse=True)
                  for x, c in zip(self.xs, per_x)]
        if self.options.unconnected == tf.UnconnectedGradients.ZERO:
            result = [g if g is not None else _tf_private.zero_gradient_like(x)
                      for g, x in zip(result, self.xs)]
        return result


def _serialize_conv_gradients(copied_ops, deferred=frozenset()):
    """Makes the Conv2DBackpropInput of each copied Conv2D wait for its
    Conv2DBackpropFilter, unless that one is deferred (it runs after the last
    segment). The two read the convolution's input and filter and the
    same incoming gradient, so they are found among those tensors' consumers."""
    for op in copied_ops:
        if op.type != "Conv2D":
            continue
        filter_grads = {tensor_key(c.inputs[2]): c for c in op.inputs[0].consumers()
                        if c.type == "Conv2DBackpropFilter" and c not in deferred}
        for consumer in op.inputs[1].consumers():
            if consumer.type == "Conv2DBackpropInput":
                partner = filter_grads.get(tensor_key(consumer.inputs[2]))
                if partner is not None:
                    _tf_private.add_control_inputs(consumer, [partner])


# Gradient ops whose outputs hold at least 1/_LARGE_FRACTION of the step's largest
# tensor are "large" (report.orders_backward).
_LARGE_FRACTION = 16


def _large_ops_needed_by(grads, made_before, excluded, min_bytes):
    """The ops made after the op numbered `made_before` (a segment's tf.gradients call)
    that its gradients `grads` need, but those in `excluded` (deferred weight gradients)
    and in v1 control-flow frames, whose outputs hold at least `min_bytes`, in the
    order they were made. (Ops nothing needs are left out: a control input from one
    would make TensorFlow run it.)"""
    stack = [t.op for g in grads if g is not None
             for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
    needed = set()
    while stack:
        op = stack.pop()
        if op in needed or op in excluded or _tf_private.creation_index(op) <= made_before:
            continue
        needed.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    large = [op for op in needed if _tf_private.control_flow_context(op) is None
             and sum(estimated_bytes(t) for t in op.outputs) >= min_bytes]
    return sorted(large, key=_tf_private.creation_index)


def _one_after_another(ops):
    """Each of `ops` (in the order they were made) waits for the one before it, through
    control inputs. An op's inputs exist before it is made, so every edge runs from an
    earlier-made op to a later-made one but the control inputs memsave adds pointing
    back (deferred weight gradients, which are left out; TensorFlow's own CPU
    convolution gradients, where no order is made): the chain closes no cycle."""
    for earlier, later in zip(ops, ops[1:]):
        _tf_private.add_control_inputs(later, [earlier])


def _readers_made_after(t, made_before):
    """The ops reading `t` that were made after the op numbered `made_before`."""
    return [r for r in t.consumers() if _tf_private.creation_index(r) > made_before]


def _reroute_readers(old, new, made_before):
    """Ops made after `made_before` that read `old` read `new` instead."""
    reroute_ts([new], [old], can_modify=_readers_made_after(old, made_before))


def _copies_that_run(copied_ops, made_before):
    """The copies a step runs: those whose outputs a gradient op (made after
    `made_before`) or another copy that runs reads; TensorFlow prunes the others."""
    members = set(copied_ops)
    running = set()
    for op in reversed(copied_ops):  # copies are made producers first
        if any((c in running) if c in members else _tf_private.creation_index(c) > made_before
               for t in op.outputs for c in t.consumers()):
            running.add(op)
    return [op for op in copied_ops if op in running]


def _wait_for(cone, trigger_ops):
    """The ops of `cone` that read nothing made within it wait for `trigger_ops`."""
    for op in cone:
        if not any(t.op in cone for t in op.inputs):
            _tf_private.add_control_inputs(op, trigger_ops)


def _exclusive_cone(gradient, made_before, returned):
    """The op making `gradient` and the ops made after index `made_before` that only it
    needs: those whose every output, and every control output, is read only within
    the set, and that make none of the tensors in `returned` (a TensorSet of
    gradients that later segments will read).

    Returns the set, or an empty one where the op makes another of `returned`, is read
    by something else through a control input, or lives in a v1 control-flow frame (a
    control input from outside the frame would be invalid)."""
    op = gradient.op
    if (any(t in returned for t in op.outputs if t.value_index != gradient.value_index)
            or _tf_private.control_outputs(op)
            or _tf_private.control_flow_context(op) is not None):
        return set()
    cone, stack = {op}, [op]
    while stack:
        for t in stack.pop().inputs:
            p = t.op
            if (p in cone or _tf_private.creation_index(p) <= made_before
                    or _tf_private.control_flow_context(p) is not None
                    or any(out in returned for out in p.outputs)):
                continue
            if (all(c in cone for out in p.outputs for c in out.consumers())
                    and all(c in cone for c in _tf_private.control_outputs(p))):
                cone.add(p)
                stack.append(p)
    return cone


def _local_input(t, gate=None):
    """A segment's own view of an outside tensor, on the tensor's device.

    An identity, not a stop_gradient: the segment's tf.gradients call stops at
    it anyway (it is one of that call's xs and stop_gradients), and a
    stop_gradient would also cut every higher-order gradient taken through
    the gradients memsave returns (they would come out None). Under XLA, `t`
    itself from a conditional on `gate` (a 1 XLA cannot fold), so the copies wait for
    the segment's gradient; exact for every value, -0.0 and NaN included.
    """
    placement = tf.device(t.op.device) if t.op.device else contextlib.nullcontext()
    with placement:
        if gate is not None and _is_number(t.dtype):
            return _gated(t, gate, name="input")
        return tf.identity(t, name="input")


def _gated(t, gate, name="gated"):
    """`t` from a conditional on `gate` (under XLA; None and non-numeric tensors pass).

    XLA materialises a conditional's operand and cannot fuse the operand's producer
    into the branch, so whoever reads the result reads `t` itself, not a copy of its
    producer (which would keep the producer's own inputs alive, e.g. convolution
    outputs from the forward pass); and it cannot run before `gate` exists.
    """
    if t is None or isinstance(t, tf.IndexedSlices) or not _is_number(t.dtype):
        return t
    return tf.cond(gate > 0.5, lambda: tf.identity(t), lambda: tf.zeros_like(t), name=name)


def _is_number(dtype):
    return dtype.is_floating or dtype.is_complex or dtype.is_integer


def _xla_gate(trigger):
    """A float32 scalar 1 computed from the data of `trigger` (the incoming gradient of
    a segment, or the ys for the last one).

    XLA ignores control inputs and merges equal computations, so copies that only
    wait for their segment's gradient through control inputs would be merged back
    into the forward pass (nothing saved). Copies that read their inputs through a
    conditional on this value differ from the forward ops and cannot run before
    `trigger` exists. It reads one element; any value (NaN, an empty tensor) gives 1
    (tf.recompute_grad does the same).
    """
    with tf.name_scope("xla_gate"):
        if trigger.dtype.is_complex:
            trigger = tf.math.real(trigger)
        first = tf.reduce_max(tf.reshape(trigger, [-1])[:1])  # -inf when empty
        as_bool = tf.cast(first, tf.bool)  # NaN -> True
        return tf.where(tf.equal(as_bool, as_bool), 1.0, float("nan"))
