"""Checking and normalising what the user passed to `memsave.gradients`.

Everything here runs before the first op is created. Each call ends one of three ways:

- the inputs are what the rewrite handles (graph tensors and variables of one
  graph, floating-point ys, dense grad_ys): a `Call` to rewrite;
- `tf.gradients` accepts them but they are nothing memsave can save memory on
  (no xs, integer or variant ys, values that are not graph tensors, tensors
  captured from an enclosing graph, sparse grad_ys): a `Call` whose `delegate`
  says why plain `tf.gradients` answers it, with the same result;
- `tf.gradients` refuses them: a MemsaveError of the type `tf.gradients` raises
  (memsave.errors), naming the problem and the fix, and the graph is unchanged.
"""

import dataclasses
from typing import List, Optional

import numpy as np
import tensorflow as tf

from memsave.errors import (MemsaveAttributeError, MemsaveError, MemsaveRuntimeError,
                            MemsaveTypeError)
from memsave.graph import _tf_private
from memsave.strategies import STRATEGIES, explicit

EAGER_HINT = (
    "memsave rewrites graphs, so it needs graph tensors: build the step inside tf.function, e.g.\n"
    "    @tf.function\n"
    "    def train_step(x, y):\n"
    "        loss = loss_fn(model(x), y)\n"
    "        grads = memsave.gradients(loss, model.trainable_variables, checkpoints='memory')\n"
    "        optimizer.apply_gradients(zip(grads, model.trainable_variables))\n"
    "or use a tf.compat.v1 Graph (tf.gradients cannot run eagerly either; eagerly, use "
    "tf.GradientTape).")


@dataclasses.dataclass
class Call:
    """One gradients call, normalised: lists of graph tensors of `graph` (variables as
    their handles), or, when `delegate` is set, the reason plain tf.gradients answers
    it (then the lists are the caller's values, unconverted)."""
    ys: list
    xs: list
    grad_ys: Optional[list]
    stop: List[tf.Tensor]
    graph: Optional[tf.Graph]
    delegate: Optional[str] = None


def normalise_call(ys, xs, grad_ys=None, stop_gradients=None):
    """Checks a gradients call's tensors and says whether memsave can rewrite it.

    Args:
      ys, xs, grad_ys, stop_gradients: as passed to tf.gradients.
    Returns:
      A Call.
    Raises:
      MemsaveError (or its TypeError, AttributeError, RuntimeError kinds, as
      tf.gradients would raise): for inputs tf.gradients refuses.
    """
    if tf.executing_eagerly() and not tf.inside_function():
        raise MemsaveRuntimeError(f"called eagerly, outside any graph; {EAGER_HINT}")
    ys, xs = _as_list(ys, "ys"), _as_list(xs, "xs")
    stop = [] if stop_gradients is None else _as_list(stop_gradients, "stop_gradients")
    grad_ys = None if grad_ys is None else _as_list(grad_ys, "grad_ys")
    if grad_ys is not None and len(grad_ys) != len(ys):
        raise MemsaveError(f"got {len(grad_ys)} grad_ys for {len(ys)} ys; pass one per y (or None)")
    _check_tensor_like(ys, "ys")
    _check_tensor_like(xs, "xs")
    _check_stop_gradients(stop)
    graph = _common_graph(_labelled(ys, "ys") + _labelled(xs, "xs")
                          + _labelled(stop, "stop_gradients") + _labelled(grad_ys or [], "grad_ys"))
    delegate = (_why_plain(ys, "ys", graph) or _why_plain(xs, "xs", graph)
                or _why_plain_grad_ys(grad_ys, graph) or _why_plain(stop, "stop_gradients", graph)
                or _why_plain_here(graph))
    if delegate:
        return Call(ys, xs, grad_ys, stop, graph, delegate)
    for i, y in enumerate(ys):
        g = None if grad_ys is None else grad_ys[i]
        if g is not None:
            _check_grad_y(g, y, i)
        elif y.dtype.is_complex:
            # (tf.gradients' own words first: code written around it matches them)
            raise MemsaveTypeError(f"Gradients of complex tensors ({y}) must set grad_ys "
                                   f"(y.dtype = {y.dtype.name}): ys[{i}] ({y.name}) is complex, "
                                   "so its gradient is not defined by default; pass grad_ys "
                                   "(e.g. tf.ones_like(y))")
    # Last: inside a tf.function this may capture a variable's handle (an op).
    xs, stop = _handles(xs, graph), _handles(stop, graph)
    return Call(ys, xs, grad_ys, stop, graph)


def _handles(values, graph):
    """Variables among `values` as the graph tensors of their handles (as tf.gradients
    takes them)."""
    return [_tf_private.graph_tensor_of_variable(v, graph) if is_variable(v) else v
            for v in values]


def _as_list(value, what):
    # As tf.gradients: a list or tuple is a list of values, anything else one value.
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (set, frozenset, dict)):
        raise MemsaveTypeError(f"{what} is a {type(value).__name__}; pass a tensor or a list/tuple "
                               "(sets and dicts have no reliable order)")
    return [value]


def is_variable(value):
    # Keras 3 variables are no tf.Variable and have no read_value, but act as
    # resource variables (tf.gradients takes them through their handle too).
    return (isinstance(value, tf.Variable) or tf.__internal__.ops.is_resource_variable(value)
            or hasattr(value, "handle") and hasattr(value, "read_value"))


def _is_graph_tensor(value):
    return isinstance(value, tf.Tensor) and not _tf_private.is_eager_tensor(value)


def _check_tensor_like(values, what):
    """What tf.gradients cannot even convert: None (AttributeError there) and ops (TypeError)."""
    for i, value in enumerate(values):
        if value is None:
            raise MemsaveAttributeError(f"{what}[{i}] is None; pass a tensor or variable (leave "
                                        f"it out of {what} if it has no gradient to give)")
        if isinstance(value, tf.Operation):
            raise MemsaveTypeError(f"{what}[{i}] is the operation {value.name}, not a tensor; "
                                   "pass one of its outputs (op.outputs[0])")


def _check_stop_gradients(stop):
    for i, value in enumerate(stop):
        if not hasattr(value, "op"):  # tf.gradients reads `.op` of each (an AttributeError)
            raise MemsaveAttributeError(f"stop_gradients[{i}] is a {type(value).__name__}, not a "
                                        "graph tensor; pass tensors of the graph being "
                                        "differentiated")


def _graph_of(value):
    """The graph of a graph tensor, sparse tensor or variable handle; None for other values."""
    if is_variable(value):
        value = getattr(value, "handle", None)
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    return value.graph if _is_graph_tensor(value) else None


def _encloses(outer, inner):
    while inner is not None:
        if inner is outer:
            return True
        inner = getattr(inner, "outer_graph", None)
    return False


def _common_graph(labelled):
    """The graph of the first graph tensor among (label, value) pairs (the ys' as a rule).

    Raises:
      MemsaveError: when a tensor belongs to an unrelated graph (tf.gradients: a
        ValueError). A tensor of an enclosing graph, captured by a function, is not
        an error (see `_why_plain`).
    """
    found = [(label, value, _graph_of(value)) for label, value in labelled]
    found = [item for item in found if item[2] is not None]
    if not found:
        return None
    first_label, first, graph = found[0]
    if _tf_private.is_func_graph(tf.compat.v1.get_default_graph()):
        return graph  # tf.gradients checks nothing there (`_why_plain` then hands it over)
    for label, value, other in found[1:]:
        if not (_encloses(graph, other) or _encloses(other, graph)):
            raise MemsaveError(f"{label} ({getattr(value, 'name', value)}) belongs to another "
                               f"graph than {first_label} ({getattr(first, 'name', first)}); pass "
                               "tensors of the graph being differentiated")
    return graph


def _labelled(values, what):
    return [(f"{what}[{i}]", v) for i, v in enumerate(values)]


def _why_plain(values, what, graph):
    """Why plain tf.gradients must answer for `values` (ys, xs or stop_gradients), or None."""
    if not values and what != "stop_gradients":
        return f"{what} is empty"
    for i, value in enumerate(values):
        label = f"{what}[{i}]"
        if what != "ys" and is_variable(value):
            if _graph_of(value) not in (None, graph):
                return f"{label} is a variable of another graph than the ys"
            continue
        if not _is_graph_tensor(value):
            return (f"{label} is a {type(value).__name__}, not a graph tensor (tf.gradients "
                    "converts it to a constant, or reads the variable)")
        if value.graph is not graph:
            return (f"{label} ({value.name}) belongs to another graph than the ys, e.g. one "
                    "enclosing theirs (captured by a function); memsave does not rewrite across "
                    "graphs")
        if what == "ys" and not (value.dtype.is_floating or value.dtype.is_complex):
            return (f"{label} ({value.name}) has dtype {value.dtype.name}: only floating-point "
                    "ys have activations worth recomputing")
    return None


def _why_plain_here(graph):
    """Why plain tf.gradients must answer a call made where the graph is now, or None."""
    if graph is not None and _tf_private.building_in_control_flow(graph):
        return ("it was called inside the body of a v1 tf.while_loop or tf.cond (e.g. "
                "tf.hessians' loop under TF1 behaviour), where memsave's copies could not "
                "read tensors from outside the frame")
    return None


def _why_plain_grad_ys(grad_ys, graph):
    for i, g in enumerate(grad_ys or []):
        if isinstance(g, tf.IndexedSlices) or isinstance(g, tf.__internal__.CompositeTensor):
            return f"grad_ys[{i}] is a {type(g).__name__} (memsave's segments take dense gradients)"
        if _is_graph_tensor(g) and g.graph is not graph:
            return f"grad_ys[{i}] ({g.name}) belongs to another graph than the ys"
    return None


def _check_grad_y(g, y, i):
    """Refuses a grad_y whose dtype or shape cannot be y's, as tf.gradients would (there
    only deep inside a gradient function, after ops were added)."""
    dtype, shape = _dtype_and_shape(g)
    if (y.dtype.is_floating or y.dtype.is_integer) and not (dtype.is_floating or dtype.is_integer):
        raise MemsaveTypeError(f"grad_ys[{i}] is a {type(g).__name__} of {dtype.name}, not a "
                               f"number; pass a tensor of the shape and dtype of ys[{i}] "
                               f"({y.name}), or None")
    if dtype != y.dtype.base_dtype:
        raise MemsaveTypeError(f"grad_ys[{i}] has dtype {dtype.name} but ys[{i}] ({y.name}) is "
                               f"{y.dtype.base_dtype.name}; cast it, e.g. "
                               f"tf.cast(grad_y, tf.{y.dtype.base_dtype.name})")
    if not shape.is_compatible_with(y.shape):
        raise MemsaveError(f"grad_ys[{i}] has shape {shape} but ys[{i}] ({y.name}) has shape "
                           f"{y.shape}; pass a gradient of the y's shape (or None for ones)")


def _dtype_and_shape(value):
    """The dtype and shape tf.convert_to_tensor would give `value`, without making an op
    (Python floats are float32 and ints int32 there, as in tf.gradients)."""
    if _is_graph_tensor(value) or _tf_private.is_eager_tensor(value):
        return value.dtype.base_dtype, value.shape
    if isinstance(value, (np.ndarray, np.generic)):
        return tf.as_dtype(value.dtype), tf.TensorShape(value.shape)
    try:
        proto = tf.make_tensor_proto(value)
    except (TypeError, ValueError) as error:
        raise MemsaveTypeError(f"grad_ys holds a {type(value).__name__}, which is no tensor; pass "
                               "tensors of the ys' shapes and dtypes, or None") from error
    return tf.as_dtype(proto.dtype), tf.TensorShape(proto.tensor_shape)


def _tensor_by_name(name, graph, index):
    try:
        return graph.get_tensor_by_name(name if ":" in name else name + ":0")
    except (KeyError, ValueError) as error:
        raise MemsaveError(f"checkpoints[{index}] names '{name}', which is not a tensor of this "
                           "graph; pass tensor objects or full names such as 'dense/Relu:0'") from error


def accepted_checkpoints():
    """Every form `checkpoints=` takes, in words: the one text of every error about it."""
    names = ", ".join(repr(name) for name in sorted(STRATEGIES))
    return (f"a list of tensors (or tensor names) to keep, one of {names}, "
            "memsave.budget(limit), or a strategy callable (region -> choices; see "
            "memsave.strategies)")


def unknown_strategy_error(checkpoints):
    """The MemsaveError for a `checkpoints=` that is none of the accepted forms."""
    if isinstance(checkpoints, str):
        return MemsaveError(f"unknown checkpoints strategy {checkpoints!r}; expected "
                            f"{accepted_checkpoints()}")
    return MemsaveError(f"checkpoints is a {type(checkpoints).__name__}; expected "
                        f"{accepted_checkpoints()}")


def resolve_strategy(checkpoints, graph):
    """Turns the `checkpoints` argument into (strategy callable, display name).

    Args:
      checkpoints: the `checkpoints` argument.
      graph: the graph being differentiated; None when the call has no graph tensors
        (it goes to tf.gradients: names are then not looked up).
    Raises:
      MemsaveError: for unknown names, non-lists, and tensors of other graphs.
    """
    if isinstance(checkpoints, str):
        if checkpoints not in STRATEGIES:
            raise unknown_strategy_error(checkpoints)
        return STRATEGIES[checkpoints], checkpoints
    if callable(checkpoints) and not isinstance(checkpoints, (tf.Tensor, tf.Variable)):
        return checkpoints, getattr(checkpoints, "__name__", "custom")
    if not isinstance(checkpoints, (list, tuple)):
        raise unknown_strategy_error(checkpoints)
    tensors = []
    for i, item in enumerate(checkpoints):
        if isinstance(item, str):
            if graph is None:
                continue  # no graph to look it up in: the call goes to tf.gradients anyway
            item = _tensor_by_name(item, graph, i)
        elif not isinstance(item, tf.Tensor) or _tf_private.is_eager_tensor(item):
            raise MemsaveError(f"checkpoints[{i}] is a {type(item).__name__}; a checkpoint list "
                               "holds graph tensors or tensor names")
        if graph is not None and item.graph is not graph:
            raise MemsaveError(f"checkpoints[{i}] ({item.name}) belongs to another graph; pass "
                               "tensors of the graph being differentiated")
        tensors.append(item)
    return explicit(tensors), "explicit list"
