"""Bad input gets memsave.MemsaveError, with a message naming the problem and the fix,
and leaves the user's graph exactly as it was (same op count). Where tf.gradients
refuses the same input, memsave's error is also of the type tf.gradients raises
(checked here against tf.gradients on the same call). Inputs tf.gradients accepts
are answered, not refused: tests/test_parity.py. Checkpoints equal to an x or a y,
or off the path, are dropped with a MemsaveWarning; the same graph rewritten twice
gives the same GraphDef.

The cases here are the ones listed in docs/troubleshooting.md's table of bad input.
"""

import functools
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.strategies import Choice

from _gradcheck import assert_same_gradients, evaluate

KINDS = ["v1", "function"]
X = np.random.RandomState(0).uniform(-1, 1, [4, 3]).astype(np.float32)


def _model(inputs):
    """x -> h -> c -> y, plus an int tensor and an unrelated tensor."""
    x = inputs["x"]
    w = tf.constant(np.eye(3, dtype=np.float32) * 0.5)
    h = tf.tanh(tf.matmul(x, w), name="h")
    c = tf.sin(h, name="c")
    y = tf.reduce_sum(c * h, name="y")
    unrelated = tf.cos(tf.ones([3]), name="unrelated")
    return {"x": x, "w": w, "h": h, "c": c, "y": y, "count": tf.size(x, name="count"),
            "unrelated": unrelated, "loss_of_unrelated": tf.reduce_sum(unrelated),
            "one_float64": tf.constant(1.0, tf.float64)}


def _names(t):
    """The model's tensor names, regex-escaped, for the message patterns (whatever names
    TensorFlow gave them)."""
    return {key: re.escape(value.name) for key, value in t.items()}


def _builtin_type(error):
    """The built-in exception class an error is an instance of (ValueError, TypeError, ...)."""
    return next(cls for cls in type(error).__mro__ if cls.__module__ == "builtins")


def assert_refused(kind, call, match, like_tf=False):
    """`call(gradients, tensors)` must raise MemsaveError matching `match` with
    memsave.gradients, adding no op; with `like_tf`, tf.gradients must refuse the
    same call, and memsave's error must be of the same built-in type.

    Returns:
      The error message.
    """
    messages = []

    def body(graph, inputs):
        t = _model(inputs)
        before = len(graph.get_operations())
        with pytest.raises(memsave.MemsaveError) as info:
            call(functools.partial(memsave.gradients, checkpoints="memory"), t)
        after = len(graph.get_operations())
        assert after == before, f"{after - before} ops were added before the error"
        messages.append((str(info.value), _names(t)))
        if like_tf:
            with pytest.raises(Exception) as tf_info:
                call(tf.compat.v1.gradients, t)
            assert isinstance(info.value, _builtin_type(tf_info.value)), (
                f"tf.gradients raises {type(tf_info.value).__name__}, memsave "
                f"{type(info.value).__mro__}")
        return {"y": t["y"]}

    evaluate(kind, body, {"x": X})
    message, names = messages[0]
    assert message.startswith("memsave: "), message
    pattern = match.format(**names)
    assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


def _other_graph_tensor():
    with tf.Graph().as_default():
        return tf.constant(1.0, name="elsewhere")


OTHER = r"elsewhere\w*:0"  # the tensor of another graph, whatever its suffix

# Calls tf.gradients refuses too: (id, call(gradients, t), pattern of the message). The
# pattern names the bad value and the fix; {y} etc. stand for the model's tensor names.
REFUSED_BY_TF_TOO = [
    ("xs_none",
     lambda g, t: g(t["y"], None),
     r"xs\[0\] is None; pass a tensor or variable"),
    ("ys_none",
     lambda g, t: g([t["y"], None], t["x"]),
     r"ys\[1\] is None"),
    ("xs_as_op",
     lambda g, t: g(t["y"], [t["x"].op]),
     r"xs\[0\] is the operation \w+, not a tensor; pass one of its outputs"),
    ("xs_as_dict",
     lambda g, t: g(t["y"], {"a": t["x"]}),
     r"xs is a dict; pass a tensor or a list/tuple"),
    ("xs_as_set",
     lambda g, t: g(t["y"], {t["x"].name}),
     r"xs is a set; pass a tensor or a list/tuple"),
    ("unexpected_kwarg",
     lambda g, t: g(t["y"], t["x"], colocate=True),
     r"unexpected keyword argument\(s\) \['colocate'\]; memsave.gradients accepts tf.gradients' "
     r"own"),
    ("grad_ys_count",
     lambda g, t: g(t["y"], t["x"], grad_ys=[None, None]),
     r"got 2 grad_ys for 1 ys; pass one per y"),
    ("grad_ys_shape",
     lambda g, t: g(t["y"], t["x"], grad_ys=[np.ones([2], np.float32)]),
     r"grad_ys\[0\] has shape \(2,\) but ys\[0\] \({y}\) has shape \(\); pass a gradient of "
     r"the y's shape"),
    ("grad_ys_dtype",
     lambda g, t: g(t["y"], t["x"], grad_ys=[t["one_float64"]]),
     r"grad_ys\[0\] has dtype float64 but ys\[0\] \({y}\) is float32; cast it"),
    ("grad_ys_numpy_dtype",
     lambda g, t: g(t["y"], t["x"], grad_ys=[np.float64(1.0)]),
     r"grad_ys\[0\] has dtype float64 but ys\[0\] \({y}\) is float32; cast it"),
    ("grad_ys_python_int",
     lambda g, t: g(t["y"], t["x"], grad_ys=2),
     r"grad_ys\[0\] has dtype int32 but ys\[0\] \({y}\) is float32"),
    ("grad_ys_string",
     lambda g, t: g(t["y"], t["x"], grad_ys=["one"]),
     r"grad_ys\[0\] is a str of string, not a number"),
    ("stop_gradients_not_tensors",
     lambda g, t: g(t["y"], t["x"], stop_gradients=[1.0]),
     r"stop_gradients\[0\] is a float, not a graph tensor"),
    ("unconnected_gradients_unknown",
     lambda g, t: g(t["y"], t["x"], unconnected_gradients="zeros"),
     r"Unknown value for unconnected_gradients: 'zeros'; expected 'none' or 'zero'"),
]

# memsave's own arguments: (id, call(t), pattern).
REFUSED_BY_MEMSAVE = [
    ("unknown_strategy",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints="fastest"),
     r"unknown checkpoints strategy 'fastest'; expected a list of tensors \(or tensor names\) "
     r"to keep, one of 'collection', 'memory', 'speed', memsave.budget\(limit\), or a strategy "
     r"callable"),
    ("checkpoint_from_another_graph",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=[t["h"], _other_graph_tensor()]),
     r"checkpoints\[1\] \(" + OTHER + r"\) belongs to another graph; pass tensors of the graph"),
    ("checkpoint_name_that_does_not_exist",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=["no_such_op:0"]),
     r"checkpoints\[0\] names 'no_such_op:0', which is not a tensor of this graph; pass tensor "
     r"objects or full names"),
    ("checkpoint_name_malformed",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=["h:first"]),
     r"checkpoints\[0\] names 'h:first'"),
    ("checkpoints_list_of_numbers",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=[1, 2]),
     r"checkpoints\[0\] is a int; a checkpoint list holds graph tensors or tensor names"),
    ("checkpoints_list_of_ops",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=[t["h"].op]),
     r"checkpoints\[0\] is a Operation; a checkpoint list holds graph tensors"),
    ("checkpoints_single_tensor",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=t["h"]),
     r"checkpoints is a \w*Tensor; expected a list of tensors \(or tensor names\) to keep, one of"),
    ("checkpoints_none",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=None),
     r"checkpoints is a NoneType; expected a list of tensors"),
    ("checkpoints_dict",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints={"h": t["h"]}),
     r"checkpoints is a dict; expected a list of tensors"),
    ("strategy_callable_returning_garbage",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=lambda region: ["h", 3]),
     r"the checkpoint strategy returned a str at position 0; a strategy returns a list of "
     r"memsave.strategies.Choice"),
    ("strategy_callable_returning_none",
     lambda t: memsave.gradients(t["y"], t["x"], checkpoints=lambda region: None),
     r"the checkpoint strategy returned a NoneType"),
    ("unknown_strategy_on_a_call_left_to_tf_gradients",
     lambda t: memsave.gradients(t["count"], t["x"], checkpoints="fastest"),
     r"unknown checkpoints strategy 'fastest'"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call,match", [c[1:] for c in REFUSED_BY_TF_TOO],
                         ids=[c[0] for c in REFUSED_BY_TF_TOO])
def test_what_tf_gradients_refuses_is_refused_with_its_exception_type(kind, call, match):
    assert_refused(kind, call, match, like_tf=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call,match", [c[1:] for c in REFUSED_BY_MEMSAVE],
                         ids=[c[0] for c in REFUSED_BY_MEMSAVE])
def test_bad_memsave_arguments_are_refused_and_the_graph_is_unchanged(kind, call, match):
    assert_refused(kind, lambda gradients, t: call(t), match)


# Refusals whose message tf.gradients' callers (TensorFlow's own gradients_test.py) match:
# memsave's message carries tf.gradients' words, then its own hint.
TF_WORDS = [
    ("unconnected_gradients",
     lambda g, t: g(t["y"], t["x"], unconnected_gradients="nonsense")),
    ("complex_ys_without_grad_ys",
     lambda g, t: g(t["complex"], t["x"])),
]


@pytest.mark.parametrize("call", [c[1] for c in TF_WORDS], ids=[c[0] for c in TF_WORDS])
def test_refusals_carry_tf_gradients_own_words(call):
    with tf.Graph().as_default():
        t = _model({"x": tf.compat.v1.placeholder(tf.float32, X.shape, name="x")})
        t["complex"] = tf.complex(t["c"], t["h"])
        with pytest.raises(Exception) as tf_info:
            call(tf.compat.v1.gradients, t)
        with pytest.raises(memsave.MemsaveError) as info:
            call(memsave.gradients, t)
    assert isinstance(info.value, _builtin_type(tf_info.value))
    assert str(tf_info.value) in str(info.value), (str(tf_info.value), str(info.value))
    assert str(info.value).startswith("memsave: ")


def test_eager_tensors_outside_any_graph():
    x = tf.constant(X)
    y = tf.reduce_sum(tf.tanh(x))
    with pytest.raises(memsave.MemsaveError, match=r"called eagerly, outside any graph; memsave "
                       r"rewrites graphs, so it needs graph tensors: build the step inside "
                       r"tf.function") as info:
        memsave.gradients(y, x)
    with pytest.raises(RuntimeError):  # what tf.gradients raises
        tf.gradients(y, x)
    assert isinstance(info.value, RuntimeError)


def test_an_eager_checkpoint_inside_a_tf_function():
    eager = tf.constant(X)
    assert_refused("function", lambda g, t: memsave.gradients(t["y"], t["x"], checkpoints=[eager]),
                   r"checkpoints\[0\] is a EagerTensor; a checkpoint list holds graph tensors")


def test_ys_from_two_graphs():
    def call(gradients, t):
        gradients([t["y"], _other_graph_tensor()], t["x"])
    assert_refused("v1", call, r"ys\[1\] \(" + OTHER + r"\) belongs to another graph than "
                   r"ys\[0\] \({y}\)", like_tf=True)


def test_xs_from_another_graph():
    # (Inside a tf.function tf.gradients does not check: tests/test_parity.py.)
    assert_refused("v1", lambda g, t: g(t["y"], [_other_graph_tensor()]),
                   r"xs\[0\] \(" + OTHER + r"\) belongs to another graph than ys\[0\] \({y}\)",
                   like_tf=True)


def test_memsave_error_is_a_value_error():
    # Code that caught tf.gradients' ValueErrors keeps working.
    assert issubclass(memsave.MemsaveError, ValueError)


# -- checkpoints dropped with a warning -------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which,why", [("x", "it is one of the xs"), ("y", "it is one of the ys"),
                                       ("unrelated", "it is not on a path from the xs to the ys")])
def test_checkpoints_equal_to_xs_ys_or_off_path_are_dropped_with_a_warning(kind, which, why):
    def body(graph, inputs):
        t = _model(inputs)
        reference = tf.compat.v1.gradients(t["y"], t["x"])
        with pytest.warns(memsave.MemsaveWarning,
                          match=re.escape(f"checkpoint {t[which].name} dropped: {why}")):
            got = memsave.gradients(t["y"], t["x"], checkpoints=[t[which], t["h"]])
        report = memsave.last_report()
        assert [c.name for c in report.checkpoints] == [t["h"].name]
        assert report.dropped == [(t[which].name, why)]
        return {"expected": reference, "got": got}
    values = evaluate(kind, body, {"x": X})
    assert_same_gradients(values["expected"], values["got"])


def test_a_custom_strategy_may_return_tensors_or_choices():
    def body(graph, inputs):
        t = _model(inputs)
        reference = tf.compat.v1.gradients(t["y"], t["x"])
        plain = memsave.gradients(t["y"], t["x"], checkpoints=lambda region: [t["h"]])
        reasons = {c.name: c.reason for c in memsave.last_report().checkpoints}
        assert reasons[t["h"].name] == "chosen by a custom strategy"
        chosen = memsave.gradients(t["y"], t["x"],
                                   checkpoints=lambda region: [Choice(t["c"], "mine")])
        reasons = {c.name: c.reason for c in memsave.last_report().checkpoints}
        assert reasons[t["c"].name] == "mine"
        return {"expected": reference, "plain": plain, "chosen": chosen}
    values = evaluate("v1", body, {"x": X})
    assert_same_gradients(values["expected"], values["plain"])
    assert_same_gradients(values["expected"], values["chosen"])


def test_python_and_numpy_grad_ys_are_accepted():
    def body(graph, inputs):
        t = _model(inputs)
        reference = tf.compat.v1.gradients([t["y"], t["h"]], t["x"],
                                           grad_ys=[2.0, np.full([4, 3], 0.5, np.float32)])
        got = memsave.gradients([t["y"], t["h"]], t["x"],
                                grad_ys=[2.0, np.full([4, 3], 0.5, np.float32)],
                                checkpoints=[t["c"]])
        return {"expected": reference, "got": got}
    values = evaluate("v1", body, {"x": X})
    assert_same_gradients(values["expected"], values["got"])


# -- determinism ----------------------------------------------------------------------------------

def _deterministic_model(x, strategy):
    w = tf.constant(np.random.RandomState(1).uniform(-1, 1, [3, 3]).astype(np.float32))
    h, hs = x, []
    for i in range(8):
        h = tf.tanh(tf.matmul(h, w)) + (hs[-2] if i % 2 and len(hs) > 1 else 0.0)
        hs.append(h)
    left, right = tf.split(h, [1, 2], axis=1)
    y = tf.reduce_sum(tf.nn.dropout(left, 0.5, seed=3)) + tf.reduce_sum(tf.sin(right))
    memsave.mark_checkpoint(hs[3])
    checkpoints = [hs[1], hs[4], left] if strategy == "list" else strategy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memsave.MemsaveWarning)
        return memsave.gradients([y, tf.reduce_mean(hs[5])], [x, w], checkpoints=checkpoints)


def _rewritten_graph_def(kind, strategy):
    if kind == "v1":
        graph = tf.Graph()
        with graph.as_default():
            _deterministic_model(tf.compat.v1.placeholder(tf.float32, [4, 3], name="x"), strategy)
        return graph.as_graph_def()
    function = tf.function(lambda x: _deterministic_model(x, strategy), autograph=False)
    return function.get_concrete_function(tf.TensorSpec([4, 3], tf.float32)).graph.as_graph_def()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", ["memory", "speed", "collection", "list"])
def test_the_same_graph_built_twice_gives_the_same_rewritten_graph_def(kind, strategy):
    first = _rewritten_graph_def(kind, strategy)
    second = _rewritten_graph_def(kind, strategy)
    assert any("recompute" in node.name for node in first.node)
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)


def _refusal(call):
    """The refusal's text (inside a tf.function, after AutoGraph's "in user code" trace)."""
    with pytest.raises(memsave.MemsaveError) as refused:
        call()
    text = str(refused.value)
    return text[text.rindex("memsave: "):].strip()


def test_every_entry_point_refuses_an_unknown_strategy_with_one_text_naming_every_form():
    def gradients():
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [2])
            memsave.gradients(tf.reduce_sum(tf.tanh(x)), [x], checkpoints="fastest")

    def tape():
        @tf.function  # (with AutoGraph, which re-raises a MemsaveError as one)
        def step(x):
            with memsave.GradientTape(checkpoints="fastest") as t:
                t.watch(x)
                y = tf.reduce_sum(tf.tanh(x))
            return t.gradient(y, x)
        step(tf.ones([2]))

    def patched():
        with memsave.patch(checkpoints="fastest"):
            pass

    texts = {name: _refusal(call) for name, call in [
        ("gradients", gradients), ("GradientTape", tape), ("patch", patched),
        ("gradient_function", lambda: memsave.gradient_function(checkpoints="fastest")),
        ("MemsaveOptimizer", lambda: memsave.MemsaveOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), checkpoints="fastest"))]}
    assert len(set(texts.values())) == 1, texts
    text = texts["gradients"]
    assert text.startswith("memsave: unknown checkpoints strategy 'fastest'; expected ")
    for form in ("a list of tensors", "'collection', 'memory', 'speed'", "memsave.budget(limit)",
                 "a strategy callable"):
        assert form in text, (form, text)
