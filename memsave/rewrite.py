"""memsave's public calls, one pipeline: inputs -> region -> plan -> build -> report.

`gradients()` checks what the caller passed (memsave.inputs), finds the forward region
(memsave.region), reads the environment once (memsave.environment), makes one frozen
Plan (memsave.planning: every decision), builds exactly it (memsave.build) and
records the report; `plan()` stops after the Plan. Where memsave can save nothing,
plain tf.gradients answers and the report says why.
"""

import contextlib
import functools
import gc
import logging
import os
import threading
import warnings

import tensorflow as tf

from memsave import batch as batch_lib
from memsave import beside as beside_lib
from memsave import build as build_lib
from memsave import inputs
from memsave import offload as offload_lib
from memsave import report as report_lib
from memsave.environment import ALWAYS_REWRITE_ENV, Environment
from memsave.errors import MemsaveError, MemsaveTypeError, MemsaveWarning
from memsave.graph import _tf_private
from memsave.graph.select import TensorSet
from memsave.planner import Problem, check_unknown_dim_size
from memsave.planning import make_plan
from memsave.region import ForwardRegion

logger = logging.getLogger(__name__)

# The real tf.gradients (captured at import by the builder: memsave.patch() may
# replace the public names).
_tf_gradients = build_lib.tf_gradients

# memsave builds graphs; it must never be transpiled by AutoGraph when called from a
# tf.function (that is slow, and would turn its Python `if`s into graph conditionals).
_graph_code = tf.autograph.experimental.do_not_convert

# `checkpoints` when the caller did not pass it: 'collection', but a fallback to plain
# tf.gradients is then not worth a warning.
_DEFAULT = type("_DefaultCheckpoints", (), {"__repr__": lambda self: "'collection'"})()

_switches = threading.local()


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
    with _switched("always_rewrite", enabled):
        yield


@contextlib.contextmanager
def _switched(name, value):
    """Sets this thread's switch `name` to `value` for the context; restores it on exit."""
    previous = getattr(_switches, name, None)
    setattr(_switches, name, value)
    try:
        yield
    finally:
        setattr(_switches, name, previous)


@contextlib.contextmanager
def answered_by_tf_gradients(graphs=None):
    """Within this context, plain tf.gradients answers memsave's gradient calls (after
    their arguments are checked): what memsave.calibrate_memory measures. `graphs`: a
    set (filled as they are traced) of the graphs whose calls it answers; a call in
    any other graph (a nested tf.function, whose trace would be kept answered so) is
    refused. None: calls in any graph. Restores the previous setting on exit."""
    with _switched("plain", _AnyGraph() if graphs is None else graphs):
        yield


class _AnyGraph:
    def __contains__(self, graph):
        return True


LOOP_MODES = ("auto", "always", "never")


def _loop_mode():
    return getattr(_switches, "recompute_loops", None) or "auto"


def _loop_chunk():
    return getattr(_switches, "loop_chunk", None) or "auto"


@contextlib.contextmanager
def recompute_loops(mode="always", chunk=None):
    """Within this context, memsave differentiates `tf.while_loop`s (while_v2 loops whose
    body may run again) through a copy that recomputes each iteration in the backward
    pass ('always'), as TensorFlow does ('never'), or where the memory model predicts the
    copy holds less than TensorFlow's gradient keeps ('auto', the default outside any
    such context). It decides nothing where plain tf.gradients answers the call (no
    saving predicted, no checkpoints) or the step is compiled by XLA. Restores the
    previous settings on exit.

    Args:
      mode: 'auto', 'always' or 'never'; None leaves the mode in force (to set the
        chunk alone).
      chunk: how many iterations the copy's gradient recomputes from one kept carry;
        None leaves the chunk in force ('auto' outside any such context).
        'auto': about the square root of the loop's iteration count,
        where the graph says the count and it is at least
        memsave.graph.loops.MIN_CHUNKED_ITERATIONS (the carry is kept at the start of
        each chunk and of each iteration of the chunk being differentiated: about
        2 sqrt(T) carries instead of T, for one more run of the loop); 1 keeps every
        iteration's carry (one run fewer); an int k: chunks of k iterations.

    Raises:
      MemsaveError: for a mode that is not one of 'auto', 'always', 'never', or a chunk
        that is not 'auto' or a positive int.
    """
    if mode is None:
        mode = _loop_mode()
    if mode not in LOOP_MODES:
        raise MemsaveError(f"unknown recompute_loops mode {mode!r}; expected one of "
                           + ", ".join(repr(m) for m in LOOP_MODES) + " (or None)")
    if chunk is None:
        chunk = _loop_chunk()
    if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise MemsaveError(f"recompute_loops chunk {chunk!r} is not 'auto' or a positive "
                           "int (iterations recomputed from one kept carry; 1: no chunks)")
    with _switched("recompute_loops", mode), _switched("loop_chunk", chunk):
        yield


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
    if _tf_private.a_tape_is_recording():
        return _plain_gradients(_plain_report(strategy_name, _TAPE_RECORDING), explicit,
                                ys, xs, grad_ys, options)
    answered = getattr(_switches, "plain", None)
    if answered is not None:
        if call.graph not in answered:
            raise MemsaveError(
                f"memsave.calibrate_memory met a gradients call in {call.graph.name!r}, not in "
                "the step's own trace (a tf.function nested in the step?), whose trace would "
                "stay answered by tf.gradients; calibrate a tf.function whose own body "
                "calls memsave")
        return _plain_gradients(_plain_report(strategy_name, _CALIBRATING), False,
                                ys, xs, grad_ys, options)
    options.stop = TensorSet(call.stop)
    with call.graph.as_default():
        region = ForwardRegion.build(call.ys, call.xs, call.stop)
        if not any(region.is_connected(x) for x in call.xs):
            return _plain_gradients(_plain_report(strategy_name, _UNCONNECTED, region), explicit,
                                    ys, xs, grad_ys, options)
        environment = Environment.read(call.graph, options.passed.get("gate_gradients"),
                                       _always_rewrite(), _loop_mode(), _loop_chunk())
        problem = _problem(region, environment, strategy, offload)
        the_plan = make_plan(problem, strategy, strategy_name, call.xs, explicit)
        report = the_plan.report()
        if the_plan.fallback:
            return _plain_gradients(report, the_plan.warn, ys, xs, grad_ys, options)
        result, built = build_lib.build(the_plan, call.ys, call.xs, call.grad_ys, options)
        built.into(report)
    report_lib.record(report)
    return result


def _problem(region, environment, strategy, offload, unknown_dim_size=None):
    """The Problem a strategy plans for: unknown dimensions count as the strategy's
    `unknown_dim_size` (memsave.budget(..., unknown_dim_size=)), else the call's
    (memsave.plan), else what the strategy's memory calibration measured them to be
    (memsave.budget(..., calibration=)), else the batch of an active memsave.batch_size
    (which memsave.keras sets from what `fit` is given), else 1; offload is the call's
    (None under XLA, with a warning); what the step holds beside the gradients that of an
    active memsave.beside.holding (memsave.keras: the optimizer's state)."""
    size = getattr(strategy, "unknown_dim_size", None) or unknown_dim_size
    source = None if size is None else "given"
    calibration = getattr(strategy, "calibration", None)
    if size is None and calibration is not None:
        size = calibration.unknown_dim_size(region.ys[0].graph)
        source = None if size is None else "measured"
    active_batch = batch_lib.current() if size is None else None
    if active_batch is not None:
        size, source = active_batch
    return Problem(region, environment, size or 1, offload_lib.usable(offload, environment),
                   unknown_dim_source=source, beside=beside_lib.current())


_UNCONNECTED = "none of the ys depends on any of the xs"
_CALIBRATING = "memsave.calibrate_memory is measuring tf.gradients' step"
# A tape recording around the call would not record memsave's copies (made by the graph
# editor, not TensorFlow's op wrappers), and its own gradients through them would be
# wrong: tf.gradients' ops it records.
_TAPE_RECORDING = ("a tf.GradientTape is recording around this call (a higher-order gradient "
                   "taken with a tape), which would not record memsave's recomputed copies")


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
    unknown_dim_size = check_unknown_dim_size(unknown_dim_size)
    if call.delegate:
        return _plain_report(strategy_name, call.delegate)
    region = ForwardRegion.build(call.ys, call.xs, call.stop)
    if not any(region.is_connected(x) for x in call.xs):
        return _plain_report(strategy_name, _UNCONNECTED, region)
    environment = Environment.read(call.graph, always_rewrite=_always_rewrite(),
                                   recompute_loops=_loop_mode(), loop_chunk=_loop_chunk())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemsaveWarning)
        problem = _problem(region, environment, strategy, offload, unknown_dim_size)
    return make_plan(problem, strategy, strategy_name, call.xs, quiet=True).report()


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
