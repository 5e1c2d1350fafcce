"""Drop-in parity: every call tf.gradients answers, memsave answers the same.

Each case builds one forward graph, then calls tf.gradients and memsave.gradients
(several strategies) on it and checks that they give the same structure (a list
with None / Tensor / IndexedSlices in the same places, the same dtypes) and the
same values, evaluated in one run; in both graph kinds where the case applies.
Cases: the inputs tf.gradients accepts but memsave cannot rewrite (answered by
plain tf.gradients, quietly), the examples of tf.gradients' documentation,
placement (colocation and devices of the gradient ops), and tf.hessians under
memsave.patch. Refused inputs, with tf.gradients' exception types, are in
tests/test_bad_inputs.py.
"""

import functools
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsave

from _gradcheck import _fetchable, assert_same_gradients, evaluate, is_copy, variable_store

KINDS = ["v1", "function"]
STRATEGIES = ["memory", "speed", "collection"]
X = np.random.RandomState(0).uniform(-1, 1, [4, 3]).astype(np.float32)


def _structure(result):
    """What a gradients result looks like, values aside."""
    if not isinstance(result, list):
        return type(result).__name__
    return [None if g is None else (type(g).__name__, g.dtype.name) for g in result]


def assert_like_tf(kind, make, call, strategies=STRATEGIES, feeds=None, rtol=1e-6):
    """`make(inputs) -> model` builds the forward graph once; `call(model, gradients)`
    takes gradients of it. tf.gradients and memsave.gradients (each strategy) must
    give the same structure and values.

    Returns:
      The memsave.last_report() of the last strategy.
    """
    reports = []

    def body(graph, inputs):
        model = make(inputs)
        expected = call(model, tf.gradients)
        fetches = {"tf": _fetchable_list(expected)}
        for strategy in strategies:
            got = call(model, functools.partial(memsave.gradients, checkpoints=strategy))
            assert _structure(got) == _structure(expected), (
                f"{strategy}: {_structure(got)}, tf.gradients: {_structure(expected)}")
            fetches[strategy] = _fetchable_list(got)
            reports.append(memsave.last_report())
        return fetches

    values = evaluate(kind, body, {"x": X} if feeds is None else feeds)
    for strategy in strategies:
        assert_same_gradients(values["tf"], values[strategy], rtol=rtol, label=strategy)
    return reports[-1]


def _fetchable_list(result):
    return [None if g is None else _fetchable(g) for g in result]


def _chain(inputs):
    x = inputs["x"]
    h = tf.tanh(x * 1.5)
    c = tf.sin(h)
    return {"x": x, "h": h, "c": c, "y": tf.reduce_sum(c * h), "count": tf.size(x),
            "unrelated": tf.reduce_sum(tf.cos(tf.ones([3])))}


# -- inputs tf.gradients accepts that memsave cannot rewrite ------------------------------------

# (id, call(model, gradients)), all on the `_chain` model.
ANSWERED_BY_PLAIN_TF = [
    ("no_y_depends_on_any_x", lambda m, g: g(m["unrelated"], m["x"])),
    ("no_y_depends_on_any_x_zero", lambda m, g: g(m["unrelated"], [m["x"]],
                                                  unconnected_gradients="zero")),
    ("empty_xs", lambda m, g: g(m["y"], [])),
    ("empty_ys", lambda m, g: g([], [m["x"]])),
    ("integer_ys", lambda m, g: g(m["count"], m["x"])),
    ("integer_ys_made_from_floats", lambda m, g: g(tf.cast(m["y"] * 10, tf.int32), m["x"])),
    ("float_and_integer_ys", lambda m, g: g([m["y"], m["count"]], m["x"])),
    ("xs_as_tensor_names", lambda m, g: g(m["y"], [m["x"].name, m["x"]])),
    ("xs_as_numpy", lambda m, g: g(m["y"], [m["x"], np.ones(3)])),
    ("ys_as_python_float", lambda m, g: g(2.0, m["x"])),
    ("grad_ys_indexed_slices",
     lambda m, g: g(m["c"], m["x"], grad_ys=tf.IndexedSlices(
         tf.ones([2, 3]), tf.constant([0, 2]), tf.constant([4, 3])))),
]


@pytest.mark.planner_fallback
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call", [c[1] for c in ANSWERED_BY_PLAIN_TF],
                         ids=[c[0] for c in ANSWERED_BY_PLAIN_TF])
def test_inputs_tf_gradients_accepts_are_answered_quietly_as_it_answers(kind, call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", memsave.MemsaveWarning)
        report = assert_like_tf(kind, _chain, call)
    assert report.fallback and report.fallback.startswith("memsave: "), report.fallback
    assert "plain tf.gradients answered the call" in report.fallback


@pytest.mark.parametrize("kind", KINDS)
def test_some_xs_unconnected(kind):
    assert_like_tf(kind, _chain, lambda m, g: g(m["y"], [m["x"], m["unrelated"], m["h"]]))
    assert_like_tf(kind, _chain, lambda m, g: g(m["y"], [m["x"], m["unrelated"]],
                                                unconnected_gradients="zero"))


def test_an_eager_tensor_as_x_inside_a_tf_function():
    eager = tf.constant(X)
    assert_like_tf("function", _chain, lambda m, g: g(m["y"], [m["x"], eager]))


@pytest.mark.parametrize("kind", KINDS)
def test_integer_tensor_array_read_of_a_while_loop(kind):
    def make(inputs):
        x = inputs["x"]
        array = tf.TensorArray(tf.int32, size=3)

        def body(i, array):
            return i + 1, array.write(i, tf.cast(tf.reduce_sum(x), tf.int32) * i)
        _, array = tf.while_loop(lambda i, _: i < 3, body, [0, array])
        return {"x": x, "y": array.read(1)}
    assert_like_tf(kind, make, lambda m, g: g(m["y"], m["x"]))


@pytest.mark.parametrize("kind", KINDS)
def test_variant_tensor_list_ys_with_tensor_list_grad_ys(kind):
    def make(inputs):
        x = inputs["x"]
        rows = tf.stack([tf.reduce_sum(x * 3.0), tf.reduce_sum(x * x)])
        shape = tf.constant([], tf.int32)
        return {"x": x, "list": tf.raw_ops.TensorListFromTensor(tensor=rows, element_shape=shape),
                "grad": tf.raw_ops.TensorListFromTensor(tensor=tf.constant([1.0, 2.0]),
                                                        element_shape=shape)}
    assert_like_tf(kind, make, lambda m, g: g(m["list"], m["x"], grad_ys=m["grad"]))


@pytest.mark.parametrize("kind", KINDS)
def test_ys_that_are_the_result_of_assign(kind):
    store = variable_store()

    def make(inputs):
        v = store("v", lambda: tf.Variable(3.0))
        x = inputs["x"]
        return {"x": x, "v": v, "assigned": v.assign(tf.reduce_sum(x) * 4.0)}
    assert_like_tf(kind, make, lambda m, g: g(m["assigned"], [m["x"], m["v"]]))


@pytest.mark.parametrize("kind", KINDS)
def test_complex_ys_with_grad_ys(kind):
    def make(inputs):
        x = tf.cast(inputs["x"], tf.complex64)
        return {"x": x, "y": tf.reduce_sum(tf.exp(x) * x)}
    assert_like_tf(kind, make, lambda m, g: g(m["y"], m["x"], grad_ys=tf.constant(1 + 2j,
                                                                                 tf.complex64)))


# -- tensors of an enclosing graph (nested tf.functions) ------------------------------------------

def _nested(inner_call):
    """A model whose gradients are taken inside an inner tf.function."""
    def make(inputs):
        x = inputs["x"]
        z = tf.tanh(x * 3.0)
        outer_y = tf.reduce_sum(tf.sin(z) * z)
        return {"x": x, "z": z, "outer_y": outer_y}

    def call(model, gradients):
        @tf.function(autograph=False)
        def inner():
            return inner_call(model, gradients)
        return inner()
    return make, call


NESTED = [
    ("inner_ys_outer_xs",
     lambda m, g: g(tf.reduce_sum(tf.sin(m["z"]) * m["z"]), [m["z"], m["x"]])),
    ("outer_ys_and_xs", lambda m, g: g(m["outer_y"], [m["x"]])),
    ("outer_ys_inner_and_outer_xs", lambda m, g: g(m["outer_y"] * 2.0, [m["x"]])),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("inner_call", [c[1] for c in NESTED], ids=[c[0] for c in NESTED])
def test_tensors_captured_from_an_enclosing_graph(kind, inner_call):
    make, call = _nested(inner_call)
    assert_like_tf(kind, make, call)


@pytest.mark.parametrize("kind", KINDS)
def test_a_variable_captured_by_an_inner_function(kind):
    store = variable_store()

    def make(inputs):
        return {"x": inputs["x"], "w": store("w", lambda: tf.Variable(np.full([3], 1.5, np.float32)))}

    def call(model, gradients):
        @tf.function(autograph=False)
        def inner():
            y = tf.reduce_sum(tf.sin(model["x"] * model["w"]) * model["w"])
            return gradients(y, [model["w"], model["x"]])
        return inner()
    assert_like_tf(kind, make, call)


@pytest.mark.parametrize("kind", KINDS)
def test_captured_through_two_levels_of_functions(kind):
    def make(inputs):
        x = inputs["x"]
        return {"x": x, "x3": tf.tanh(x) * 2.0}

    def call(model, gradients):
        @tf.function(autograph=False)
        def outer():
            middle = tf.sin(model["x"])

            @tf.function(autograph=False)
            def inner():
                ys = [tf.identity(middle), tf.identity(model["x3"]) * 3.0, model["x"]]
                return gradients(ys, [model["x"], model["x3"]])
            return inner()
        return outer()
    assert_like_tf(kind, make, call)


# -- graphs of the kinds tf.gradients' own tests use -------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_ys_that_depend_on_each_other(kind):
    def make(inputs):
        y = tf.square(inputs["x"])
        y2 = tf.square(tf.square(y))
        return {"x": inputs["x"], "y": y, "y2": y2}
    assert_like_tf(kind, make, lambda m, g: g([m["y"], m["y2"]], m["x"]))
    assert_like_tf(kind, make, lambda m, g: g([tf.identity(m["y"]), tf.identity(m["y2"])],
                                              m["x"]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_custom_gradient_on_the_path(kind):
    @tf.custom_gradient
    def scaled_identity(x):
        return tf.identity(x), lambda dy: 3.0 * dy

    def make(inputs):
        h = scaled_identity(tf.tanh(inputs["x"]))
        return {"x": inputs["x"], "y": tf.reduce_sum(tf.sin(scaled_identity(h)) * h)}
    assert_like_tf(kind, make, lambda m, g: g(m["y"], m["x"]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_cond_reading_a_variable(kind):
    store = variable_store()

    def make(inputs):
        gamma = store("gamma", lambda: tf.Variable(np.linspace(0.5, 1.5, 3).astype(np.float32)))
        flag = tf.reduce_sum(inputs["x"]) > -100.0
        out = tf.cond(flag, lambda: tf.tanh(inputs["x"] + gamma), lambda: inputs["x"])
        return {"x": inputs["x"], "gamma": gamma, "y": tf.reduce_sum(tf.sin(out) * out)}
    assert_like_tf(kind, make, lambda m, g: g(m["y"], [m["gamma"], m["x"]]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_read_value_of_a_variable(kind):
    store = variable_store()

    def make(inputs):
        return {"v": store("v", lambda: tf.Variable(100.0))}
    assert_like_tf(kind, make, lambda m, g: g(m["v"].read_value(), m["v"]))
    assert_like_tf(kind, make, lambda m, g: g(tf.constant(0.0), m["v"],
                                              unconnected_gradients="zero"))


@pytest.mark.parametrize("kind", KINDS)
def test_stop_gradients_equal_stop_gradient_ops(kind):
    rng = np.random.RandomState(3)
    mats = [rng.rand(3, 3).astype(np.float32) for _ in range(8)]

    def make(inputs):
        a = tf.tanh(inputs["x"][:3] @ mats[0])
        b = tf.tanh(mats[1] @ a)
        c = tf.tanh(mats[2] @ a + mats[3] @ b)
        d = tf.reduce_sum(tf.sin(mats[4] @ b + mats[5] @ c))
        return {"a": a, "b": b, "c": c, "d": d}
    for stops in (["a"], ["b"], ["a", "c"], ["b", "c"], ["a", "b", "c"]):
        assert_like_tf(kind, make, lambda m, g: g(m["d"], [m["a"], m["b"], m["c"]],
                                                  stop_gradients=[m[k] for k in stops]))


def test_a_variable_in_stop_gradients():
    # tf.compat.v1 graphs only: inside a tf.function a variable has no `.op`, and
    # tf.gradients raises an AttributeError there (memsave: a MemsaveAttributeError).
    store = variable_store()

    def make(inputs):
        w = store("w", lambda: tf.compat.v1.Variable(np.full([3], 0.5, np.float32)))
        h = tf.tanh(inputs["x"] * w)
        return {"x": inputs["x"], "w": w, "y": tf.reduce_sum(tf.sin(h) * h)}
    assert_like_tf("v1", make, lambda m, g: g(m["y"], [m["x"], m["w"]], stop_gradients=[m["w"]]))


# -- the examples of tf.gradients' documentation ----------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_documentation_examples(kind):
    def make(inputs):
        a = tf.reduce_sum(inputs["x"])
        b = 2.0 * a
        return {"a": a, "b": b, "ones_a": tf.ones([1, 2]) * a,
                "stopped": tf.stop_gradient(tf.ones([3, 1]) * a)}
    # stop_gradients: partial derivatives, not totals.
    assert_like_tf(kind, make, lambda m, g: g(m["a"] + m["b"], [m["a"], m["b"]],
                                              stop_gradients=[m["a"], m["b"]]))
    # total derivatives
    assert_like_tf(kind, make, lambda m, g: g(m["a"] + m["b"], [m["a"], m["b"]]))
    # unconnected gradients: None or zeros
    for unconnected in ("none", "zero", tf.UnconnectedGradients.ZERO):
        assert_like_tf(kind, make, lambda m, g: g([m["stopped"]], [m["ones_a"]],
                                                  unconnected_gradients=unconnected))


@pytest.mark.parametrize("kind", KINDS)
def test_keyword_arguments_pass_through(kind):
    for kwargs in ({"gate_gradients": True},
                   {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE},
                   {"aggregation_method": tf.AggregationMethod.ADD_N},
                   {"name": "my_gradients"}):
        assert_like_tf(kind, _chain, lambda m, g: g([m["y"], m["c"]], [m["x"], m["h"]], **kwargs))


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_gradients_stay_sparse(kind):
    store = variable_store()

    def make(inputs):
        table = store("table", lambda: tf.Variable(np.ones([10, 3], np.float32)))
        rows = tf.gather(table, [1, 4, 4])
        return {"table": table, "y": tf.reduce_sum(tf.tanh(rows * inputs["x"][:3]))}
    assert_like_tf(kind, make, lambda m, g: g(m["y"], [m["table"]]))


# -- placement ---------------------------------------------------------------------------------

def _placed_model():
    """w on /gpu:1, two matmuls of w, their sum on /gpu:0 (never run: placement only)."""
    with tf.device("/gpu:1"):
        w = tf.constant(np.ones([1, 1], np.float32), name="w")
    x = tf.constant(np.ones([1, 2], np.float32))
    y = tf.constant(np.ones([1, 2], np.float32))
    wx = tf.tanh(tf.matmul(w, x))
    wy = tf.tanh(tf.matmul(w, y))
    with tf.device("/gpu:0"):
        z = tf.sin(wx) + tf.sin(wy)
    return w, z


def _colocated_with(op):
    """The ops `op` is colocated with (its own op when it has no colocation attribute)."""
    return [op.graph.get_operation_by_name(group.decode()[len("loc:@"):])
            for group in op.colocation_groups()]


def _same_placement(expected, got):
    """tf.gradients' op and memsave's have the same device and are colocated with the same
    kind of op on the same device. (A sum is colocated with its first contribution, and
    memsave's segments may add contributions in another order than tf.gradients.)"""
    assert got.device == expected.device, (got.name, got.device, expected.device)
    for want, have in zip(_colocated_with(expected), _colocated_with(got)):
        assert have.type == want.type and have.device == want.device, (want.name, have.name)


def test_a_gradient_is_colocated_with_its_forward_op():
    graph = tf.Graph()
    with graph.as_default():
        w = tf.constant(np.ones([1, 1], np.float32))
        with tf.device("/device:GPU:0"):
            wx = tf.matmul(w, tf.ones([1, 2]))
        z = tf.reduce_sum(tf.sin(tf.tanh(wx)))
        got = memsave.gradients(z, [w], checkpoints=[z.op.inputs[0]],
                                colocate_gradients_with_ops=True)[0]
        assert memsave.last_report().segments
    assert got.op.colocation_groups() == wx.op.colocation_groups()
    assert got.device == "/device:GPU:0"


@pytest.mark.parametrize("colocate", [True, False])
def test_gradients_are_placed_as_tf_gradients_places_them(colocate):
    graph = tf.Graph()
    with graph.as_default():
        w, z = _placed_model()
        before = len(graph.get_operations())
        expected = tf.compat.v1.gradients(z, [w], colocate_gradients_with_ops=colocate)[0]
        tf_ops = graph.get_operations()[before:]
        before = len(graph.get_operations())
        got = memsave.gradients(z, [w], checkpoints=[z.op.inputs[0]],
                                colocate_gradients_with_ops=colocate)[0]
        memsave_ops = [op for op in graph.get_operations()[before:]
                       if "gradients/" in op.name or "grad_sum" in op.name]
    assert memsave.last_report().segments, "the rewrite was not built"
    _same_placement(expected.op, got.op)
    # Gradient ops land on the devices tf.gradients' land on: those of their forward ops
    # when colocating, the caller's device scope (none here) otherwise.
    assert {op.device for op in memsave_ops} == {op.device for op in tf_ops}
    if not colocate:
        assert {op.device for op in memsave_ops} == {""}


def test_gradient_function_keeps_colocate_gradients_with_ops_false():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/gpu:1"):
            w = tf.constant(np.ones([1, 1], np.float32))
            wx = tf.tanh(tf.matmul(w, tf.ones([1, 2])))
        with tf.device("/gpu:0"):
            z = tf.reduce_sum(tf.sin(wx) * wx)
        assert tf.compat.v1.gradients(z, [w])[0].device == ""  # v1's default: no colocation
        colocated = memsave.gradients(z, [w], checkpoints="memory")[0]  # tf.gradients': colocate
        assert memsave.last_report().segments
        assert colocated.device == "/device:GPU:1"
        got = memsave.gradient_function("memory")(z, [w])[0]
        assert memsave.last_report().segments
        # Nothing marked for 'collection': plain tf.gradients answers, not colocating either.
        plain = memsave.gradient_function("collection")(z, [w])[0]
        assert memsave.last_report().fallback
    assert got.device == "" and plain.device == ""


# -- patch: tf.hessians, and no warnings on fallbacks -------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rank", [1, 2])
def test_hessians_go_through_memsave_under_patch(kind, rank):
    def body(graph, inputs):
        x = inputs["x"] if rank == 2 else inputs["x"][0]
        y = tf.reduce_sum(tf.sin(tf.tanh(x * 1.5)) * x)
        expected = tf.hessians(y, x)
        memsave.report._latest.report = None
        with memsave.patch(checkpoints="memory"):
            got = tf.hessians(y, x)
            v1 = tf.compat.v1.hessians(y, x)
        assert memsave.last_report() is not None, "tf.hessians did not call memsave"
        return {"expected": expected, "got": got, "v1": v1}
    values = evaluate(kind, body, {"x": X})
    assert_same_gradients(values["expected"], values["got"])
    assert_same_gradients(values["expected"], values["v1"])


@pytest.mark.planner_fallback
@pytest.mark.parametrize("kind", KINDS)
def test_a_patched_program_is_quiet_where_nothing_can_be_saved(kind):
    def body(graph, inputs):
        m = _chain(inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", memsave.MemsaveWarning)
            with memsave.patch(checkpoints="memory"):
                got = tf.gradients(m["y"], m["x"])
            assert memsave.last_report().fallback
            got_budget = memsave.gradients(m["y"], m["x"], checkpoints=memsave.budget(1.0))
        # A checkpoint list the caller gave and memsave does not use: a warning.
        with pytest.warns(memsave.MemsaveWarning, match="plain tf.gradients"):
            memsave.gradients(m["y"], m["x"], checkpoints=[m["h"]])
        return {"expected": tf.gradients(m["y"], m["x"]), "got": got, "budget": got_budget}
    values = evaluate(kind, body, {"x": X})
    assert_same_gradients(values["expected"], values["got"])
    assert_same_gradients(values["expected"], values["budget"])


def test_the_plan_of_a_call_left_to_tf_gradients_says_why():
    graph = tf.Graph()
    with graph.as_default():
        m = _chain({"x": tf.constant(X)})
        report = memsave.plan(m["count"], m["x"], checkpoints="memory")
        assert re.search(r"has dtype int32", report.fallback)
        report = memsave.plan(m["unrelated"], m["x"], checkpoints="memory")
        assert "none of the ys depends on any of the xs" in report.fallback


# -- TensorFlow 1 behaviour ---------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("MEMSAVE_TEST_V1_BEHAVIOUR") == "1", reason="the child run")
def test_parity_under_disable_v2_behavior():
    """The tf.compat.v1-graph cases of this module and of test_bad_inputs.py again, in a
    process where tf.compat.v1.disable_v2_behavior() is in force (v1 while loops and
    conds, ref variables, no eager execution)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MEMSAVE_TEST_V1_BEHAVIOUR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join(here, "test_parity.py"), os.path.join(here, "test_bad_inputs.py"),
         "-k", "not function and not eager and not disable_v2_behavior"],
        capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\b[1-9]\d+ passed", proc.stdout), proc.stdout[-1000:]
