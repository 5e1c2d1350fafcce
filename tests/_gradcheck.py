"""Helpers of the hard-graph, property and bad-input tests (issue 6).

`compare_strategies(kind, build, ...)` builds one graph (a tf.compat.v1 Graph or
a tf.function body), takes `tf.gradients` and `memsave.gradients` for several
checkpoint strategies *in the same graph*, evaluates all of them in one
`Session.run` / one function call (so random ops draw once and every gradient
sees the same forward values) and asserts they agree.
"""

import collections
import re
import warnings

import numpy as np
import tensorflow as tf

import memsave

# What a case builder returns. ys, xs and kwargs go to both gradient functions;
# `lists` are explicit checkpoint lists (each tried as its own strategy);
# `marks` are marked with memsave.mark_checkpoint for the 'collection' strategy;
# `fetch` is anything else to evaluate in the same run (a dict of tensors).
Case = collections.namedtuple("Case", ["ys", "xs", "lists", "marks", "kwargs", "fetch"],
                              defaults=((), (), None, None))

NAMED_STRATEGIES = ("memory", "speed", "collection")
# A copy made by the rewrite is named <scope>/<segment>/recompute/<original name>;
# gradient ops of copies have "gradients/" before their "recompute/".
_COPY_NAME = re.compile(r"^(?:(?!gradients/).)*?/recompute/")


def is_copy(op):
    """Whether `op` is one of the recomputed copies memsave made."""
    return _COPY_NAME.match(op.name) is not None


def stateful_copies(ops):
    """Names of the recomputed copies among `ops` whose op is stateful (a call of a
    function is as stateful as that function: memsave.graph.calls)."""
    from memsave.graph import calls

    def stateful(op):
        if calls.is_call(op):
            return calls.why_call_not_repeatable(op) is not None
        return op.op_def is not None and op.op_def.is_stateful
    return [op.name for op in ops if is_copy(op) and stateful(op)]


def clipped_square(record, bound):
    """t * t with a gradient that is not linear in its incoming gradient (clipped to
    +-bound), calling `record(dy)` each time its gradient function runs."""
    @tf.custom_gradient
    def square(t):
        def grad(dy):
            record(dy)
            return tf.clip_by_value(dy * 2.0 * t, -bound, bound)
        return t * t, grad
    return square


def variable_store():
    """`get(key, make)`: one variable, `make()`, per key for the caller's graph.

    A tf.function body may be traced more than once but must create its
    variables only once; in a v1 graph the variable belongs to that graph.
    Created under tf.init_scope (eager for a tf.function, the graph for v1).
    """
    store = {}

    def get(key, make):
        graph = tf.compat.v1.get_default_graph()
        owner = None if getattr(graph, "building_function", False) else graph
        if (owner, key) not in store:
            with tf.init_scope():
                store[(owner, key)] = make()
        return store[(owner, key)]
    return get


def strategies_of(case, named=NAMED_STRATEGIES):
    """(label, checkpoints argument) pairs for a case: the named strategies and its lists."""
    pairs = [(name, name) for name in named]
    pairs += [(f"list{i}", list(checkpoints)) for i, checkpoints in enumerate(case.lists)]
    return pairs


def _fetchable(gradient):
    """A gradient as something both graph kinds can return (IndexedSlices as a triple)."""
    if isinstance(gradient, tf.IndexedSlices):
        shape = gradient.dense_shape
        if shape is None:
            shape = tf.shape(gradient.values, out_type=gradient.indices.dtype)
        return {"values": gradient.values, "indices": gradient.indices, "dense_shape": shape}
    return gradient


def as_dense(value):
    """A fetched gradient (array, IndexedSlices value or its triple) as a float64 (or
    complex128) array."""
    if isinstance(value, dict):
        values, indices, shape = value["values"], value["indices"], value["dense_shape"]
    elif hasattr(value, "indices") and hasattr(value, "values"):
        values, indices, shape = value.values, value.indices, value.dense_shape
    else:
        return np.asarray(value, dtype=_dtype_of(value))
    dense = np.zeros(np.asarray(shape), _dtype_of(values))
    np.add.at(dense, np.asarray(indices), np.asarray(values, _dtype_of(values)))
    return dense


def _dtype_of(value):
    return np.complex128 if np.iscomplexobj(value) else np.float64


def assert_same_gradients(expected, got, rtol=1e-5, label="", atol=0.0):
    """Asserts each gradient of `got` equals the one of `expected` (None for None).

    The error of gradient i is max|got - expected| divided by the larger of
    max|expected_i| and 1% of the largest expected gradient of all: gradients
    that are mathematically zero (a bias right before batch norm) are pure
    rounding noise, and dividing by their own size would compare noise with noise.
    Errors of at most `atol` pass whatever the scale: where every gradient is zero
    in exact arithmetic (the sum of a batch-normalised tensor), all are noise.
    """
    assert len(expected) == len(got), f"{label}: {len(got)} gradients, expected {len(expected)}"
    dense = [None if e is None else as_dense(e) for e in expected]
    overall = max([np.max(np.abs(e)) for e in dense if e is not None and e.size] + [0.0])
    for i, (e, g) in enumerate(zip(dense, got)):
        if e is None:
            assert g is None, f"{label}: gradient {i}: tf.gradients gives None, memsave does not"
            continue
        assert g is not None, f"{label}: gradient {i}: memsave gives None, tf.gradients does not"
        g = as_dense(g)
        assert g.shape == e.shape, f"{label}: gradient {i}: shape {g.shape}, expected {e.shape}"
        if not e.size:
            continue
        assert np.all(np.isfinite(g)) == np.all(np.isfinite(e)), f"{label}: gradient {i} not finite"
        scale = max(np.max(np.abs(e)), 0.01 * overall, 1e-30)
        error = np.max(np.abs(e - g)) / scale
        assert error <= rtol or np.max(np.abs(e - g)) <= atol, f"{label}: gradient {i}: relative error {error:.3g} > {rtol:g}"


def _memsave_gradients(graph, case, checkpoints, sparse_kinds, label):
    before = len(graph.get_operations())
    with warnings.catch_warnings():
        # Strategies that find nothing to keep fall back to tf.gradients with a warning.
        warnings.simplefilter("ignore", memsave.MemsaveWarning)
        result = memsave.gradients(case.ys, case.xs, checkpoints=checkpoints, **(case.kwargs or {}))
    new_ops = graph.get_operations()[before:]
    bad = stateful_copies(new_ops)
    assert not bad, f"{label}: stateful ops were copied: {bad}"
    sparse_kinds[label] = [isinstance(g, tf.IndexedSlices) for g in result]
    return [None if g is None else _fetchable(g) for g in result]


def build_all(graph, case, strategies, sparse_kinds):
    """Marks the case's checkpoints and builds tf.gradients and every strategy's gradients."""
    for t in case.marks:
        memsave.mark_checkpoint(t)
    reference = tf.compat.v1.gradients(case.ys, case.xs, **(case.kwargs or {}))
    sparse_kinds["tf"] = [isinstance(g, tf.IndexedSlices) for g in reference]
    fetches = {"tf": [None if g is None else _fetchable(g) for g in reference]}
    for label, checkpoints in strategies:
        fetches[label] = _memsave_gradients(graph, case, checkpoints, sparse_kinds, label)
    fetches["extra"] = case.fetch or {}
    return fetches


def evaluate(kind, body, feeds=None, batch_none=False):
    """Runs `body(graph, inputs) -> fetches` in a graph of `kind` ("v1" or "function").

    Variables created by `body` are initialised (v1) or lifted (tf.function,
    first call). `batch_none` gives every input an unknown first dimension.
    Returns the fetches as numpy values (None stays None).
    """
    feeds = {name: np.asarray(value) for name, value in (feeds or {}).items()}

    def shape_of(value):
        shape = list(value.shape)
        if batch_none and shape:
            shape[0] = None
        return shape

    if kind == "v1":
        graph = tf.Graph()
        with graph.as_default():
            inputs = {name: tf.compat.v1.placeholder(tf.as_dtype(v.dtype), shape_of(v), name=name)
                      for name, v in feeds.items()}
            fetches = body(graph, inputs)
            init = tf.compat.v1.global_variables_initializer()
            flat = tf.nest.flatten(fetches)
            present = [t for t in flat if t is not None]
            with tf.compat.v1.Session(graph=graph) as session:
                session.run(init)
                got = iter(session.run(present, {inputs[n]: v for n, v in feeds.items()}))
            # Session.run refuses None fetches; they come back as None.
            return tf.nest.pack_sequence_as(fetches, [None if t is None else next(got) for t in flat])
    if kind != "function":
        raise ValueError(f"unknown graph kind {kind!r}")
    names = list(feeds)
    signature = [tf.TensorSpec(shape_of(feeds[n]), tf.as_dtype(feeds[n].dtype), name=n)
                 for n in names]

    @tf.function(input_signature=signature, autograph=False)
    def function_body(*args):
        return body(tf.compat.v1.get_default_graph(), dict(zip(names, args)))

    result = function_body(*[tf.constant(feeds[n]) for n in names])
    return tf.nest.map_structure(lambda t: None if t is None else t.numpy(), result)


def compare_strategies(kind, build, feeds=None, named=NAMED_STRATEGIES, rtol=1e-5,
                       batch_none=False):
    """Builds `build(inputs) -> Case` and checks memsave against tf.gradients.

    Every strategy (the named ones and the case's lists) must give the
    gradients of tf.gradients, keep IndexedSlices where tf.gradients gives them,
    and copy no stateful op. Everything is evaluated in one run.

    Returns:
      (fetched values by label, with "extra" for the case's own fetches;
       IndexedSlices flags by label).
    """
    sparse_kinds = {}

    def body(graph, inputs):
        case = build(inputs)
        return build_all(graph, case, strategies_of(case, named), sparse_kinds)

    values = evaluate(kind, body, feeds, batch_none=batch_none)
    for label, got in values.items():
        if label in ("tf", "extra"):
            continue
        assert_same_gradients(values["tf"], got, rtol=rtol, label=f"{kind}/{label}")
        assert sparse_kinds[label] == sparse_kinds["tf"], (
            f"{kind}/{label}: IndexedSlices where tf.gradients has them: "
            f"{sparse_kinds['tf']}, memsave: {sparse_kinds[label]}")
    return values, sparse_kinds
