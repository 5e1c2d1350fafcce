"""Checking and normalising what the user passed to `memsave.gradients`.

Everything here runs before the first op is created, so bad input never leaves
the user's graph half-rewritten.
"""

import numpy as np
import tensorflow as tf

from memsave.errors import MemsaveError
from memsave.graph import _tf_private
from memsave.strategies import STRATEGIES, explicit

EAGER_HINT = (
    "memsave rewrites graphs, so it needs graph tensors: build the step inside tf.function, e.g.\n"
    "    @tf.function\n"
    "    def train_step(x, y):\n"
    "        loss = loss_fn(model(x), y)\n"
    "        grads = memsave.gradients(loss, model.trainable_variables, checkpoints='memory')\n"
    "        optimizer.apply_gradients(zip(grads, model.trainable_variables))\n"
    "or use a tf.compat.v1 Graph.")


def _as_list(value, what):
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (set, frozenset, dict)):
        raise MemsaveError(f"{what} is a {type(value).__name__}; pass a tensor or a list/tuple "
                           "(sets and dicts have no reliable order)")
    return [value]


def _is_variable(value):
    # Keras 3 variables are no tf.Variable and have no read_value, but act as
    # resource variables (tf.gradients takes them through their handle too).
    return (isinstance(value, tf.Variable) or tf.__internal__.ops.is_resource_variable(value)
            or hasattr(value, "handle") and hasattr(value, "read_value"))


def _check_graph_tensor(t, what):
    if _tf_private.is_eager_tensor(t):
        raise MemsaveError(f"{what} is an eager tensor; {EAGER_HINT}")
    if not isinstance(t, (tf.Tensor, tf.IndexedSlices)):
        raise MemsaveError(f"{what} is a {type(t).__name__}, not a graph tensor; pass tf.Tensor "
                           "objects produced by ops of the graph being differentiated")


def normalise_ys(ys):
    """Returns ys as a non-empty list of floating graph tensors, all of one graph."""
    if tf.executing_eagerly() and not tf.inside_function():
        raise MemsaveError(f"called eagerly, outside any graph; {EAGER_HINT}")
    ys = _as_list(ys, "ys")
    if not ys:
        raise MemsaveError("ys is empty; pass the tensor (or list of tensors) to differentiate")
    for i, y in enumerate(ys):
        _check_graph_tensor(y, f"ys[{i}]")
        if not (y.dtype.is_floating or y.dtype.is_complex):
            raise MemsaveError(f"ys[{i}] ({y.name}) has dtype {y.dtype.name}; gradients need "
                               "floating-point ys: cast it, e.g. tf.cast(y, tf.float32)")
    graph = ys[0].graph
    for i, y in enumerate(ys[1:], start=1):
        if y.graph is not graph:
            raise MemsaveError(f"ys[{i}] ({y.name}) belongs to another graph than ys[0]; "
                               "all ys must come from one graph")
    return ys, graph


def normalise_xs(xs, graph):
    """Returns xs as a non-empty list of graph tensors of `graph` (variables -> their handles)."""
    xs = _as_list(xs, "xs")
    if not xs:
        raise MemsaveError("xs is empty; pass the tensors or variables to differentiate with "
                           "respect to, e.g. model.trainable_variables")
    return _graph_tensors_of(xs, "xs", graph)


def _graph_tensors_of(values, what, graph):
    """Tensors or variables (-> their handle in `graph`) as graph tensors of `graph`."""
    result = []
    for i, value in enumerate(values):
        if _is_variable(value):
            value = _tf_private.graph_tensor_of_variable(value, graph)
        else:
            _check_graph_tensor(value, f"{what}[{i}]")
        if value.graph is not graph:
            raise MemsaveError(f"{what}[{i}] ({value.name}) belongs to another graph than ys; "
                               "pass tensors of the graph being differentiated")
        result.append(value)
    return result


def normalise_grad_ys(grad_ys, ys):
    """Returns grad_ys as a list matching ys, or None."""
    if grad_ys is None:
        return None
    grad_ys = _as_list(grad_ys, "grad_ys")
    if len(grad_ys) != len(ys):
        raise MemsaveError(f"got {len(grad_ys)} grad_ys for {len(ys)} ys; pass one per y (or None)")
    for i, (g, y) in enumerate(zip(grad_ys, ys)):
        if g is not None:
            _check_grad_y(g, y, i)
    return grad_ys


def _check_grad_y(g, y, i):
    # tf.gradients would fail on these only deep inside a segment, after copies exist.
    if isinstance(g, (tf.Tensor, tf.Variable)) and not _tf_private.is_eager_tensor(g):
        if g.graph is not y.graph:
            raise MemsaveError(f"grad_ys[{i}] ({g.name}) belongs to another graph than ys[{i}]; "
                               "build grad_ys in the graph of the ys")
        dtype, shape = g.dtype.base_dtype, g.shape
    else:
        # A Python number (converted to y's dtype), a numpy array or an eager tensor.
        value = np.asarray(g.numpy() if _tf_private.is_eager_tensor(g) else g)
        if value.dtype.kind not in "fiuc":
            raise MemsaveError(f"grad_ys[{i}] is a {type(g).__name__}, not a tensor; pass a tensor "
                               f"of the shape and dtype of ys[{i}] ({y.name}), or None")
        python_number = isinstance(g, (int, float)) and not isinstance(g, np.generic)
        dtype = None if python_number else tf.as_dtype(value.dtype)
        shape = tf.TensorShape(value.shape)
    if dtype is not None and dtype != y.dtype.base_dtype:
        raise MemsaveError(f"grad_ys[{i}] has dtype {dtype.name} but ys[{i}] ({y.name}) is "
                           f"{y.dtype.base_dtype.name}; cast it, e.g. "
                           f"tf.cast(grad_y, tf.{y.dtype.base_dtype.name})")
    if not shape.is_compatible_with(y.shape):
        raise MemsaveError(f"grad_ys[{i}] has shape {shape} but ys[{i}] ({y.name}) has shape "
                           f"{y.shape}; pass a gradient of the y's shape (or None for ones)")


def normalise_stop_gradients(stop_gradients, graph):
    """Returns the stop_gradients argument as a list of graph tensors of `graph`."""
    if stop_gradients is None:
        return []
    return _graph_tensors_of(_as_list(stop_gradients, "stop_gradients"), "stop_gradients", graph)


def _tensor_by_name(name, graph, index):
    try:
        return graph.get_tensor_by_name(name if ":" in name else name + ":0")
    except (KeyError, ValueError) as error:
        raise MemsaveError(f"checkpoints[{index}] names '{name}', which is not a tensor of this "
                           "graph; pass tensor objects or full names such as 'dense/Relu:0'") from error


def resolve_strategy(checkpoints, graph):
    """Turns the `checkpoints` argument into (strategy callable, display name).

    Raises:
      MemsaveError: for unknown names, non-lists, and tensors of other graphs.
    """
    if isinstance(checkpoints, str):
        if checkpoints not in STRATEGIES:
            raise MemsaveError(f"unknown checkpoints strategy '{checkpoints}'; expected a list of "
                               f"tensors or one of {', '.join(repr(k) for k in sorted(STRATEGIES))}")
        return STRATEGIES[checkpoints], checkpoints
    if callable(checkpoints) and not isinstance(checkpoints, (tf.Tensor, tf.Variable)):
        return checkpoints, getattr(checkpoints, "__name__", "custom")
    if not isinstance(checkpoints, (list, tuple)):
        raise MemsaveError(f"checkpoints is a {type(checkpoints).__name__}; expected a list of "
                           f"tensors (or tensor names) or one of "
                           f"{', '.join(repr(k) for k in sorted(STRATEGIES))}")
    tensors = []
    for i, item in enumerate(checkpoints):
        if isinstance(item, str):
            item = _tensor_by_name(item, graph, i)
        elif not isinstance(item, tf.Tensor) or _tf_private.is_eager_tensor(item):
            raise MemsaveError(f"checkpoints[{i}] is a {type(item).__name__}; a checkpoint list "
                               "holds graph tensors or tensor names")
        if item.graph is not graph:
            raise MemsaveError(f"checkpoints[{i}] ({item.name}) belongs to another graph; pass "
                               "tensors of the graph being differentiated")
        tensors.append(item)
    return explicit(tensors), "explicit list"
