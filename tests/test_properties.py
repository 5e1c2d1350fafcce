"""Property-based tests: on random DAGs, with random checkpoint sets, memsave.gradients
equals tf.gradients (relative error <= 1e-5 in float32).

The DAGs mix elementwise ops, add/sub/mul, matmuls (weights sometimes among the
xs), concat followed by split (multi-output ops), residual skips, dropout,
existing stop_gradients, dead ends and a branch that does not depend on the xs,
sometimes with grad_ys, an intermediate tensor among the xs and a
stop_gradients= argument. The checkpoint sets are random subsets of every tensor
of the graph: tensors on the path, the xs, the ys and tensors off the path
(memsave drops those with a warning), plus the 'memory' and 'speed' strategies.
Graphs whose ys depend on no x must be refused with MemsaveError, adding no op.

Size of the run:
  default (CI): MEMSAVE_HYPOTHESIS_EXAMPLES unset -> 50 v1 graphs + 10 tf.function graphs
                (100 + 20 took 30 s of CI's 15 minutes; tests/test_fuzz.py draws more kinds);
  larger:       MEMSAVE_HYPOTHESIS_EXAMPLES=2000 pytest tests/test_properties.py
                --hypothesis-show-statistics   (the tf.function test gets a tenth).
Each example builds one small graph and evaluates tf.gradients and four to six
memsave rewrites of it ('memory', 'speed', 'collection' and 1-3 random lists) in
a single Session.run / function call.
"""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memsave

from _gradcheck import Case, assert_same_gradients, build_all, evaluate

EXAMPLES = int(os.environ.get("MEMSAVE_HYPOTHESIS_EXAMPLES", "50"))
FUNCTION_EXAMPLES = max(10, EXAMPLES // 10)
BATCH, WIDTH = 3, 4
UNARY = ("tanh", "sin", "sigmoid", "scale", "square", "stop_gradient", "dropout")
BINARY = ("add", "sub", "mul", "residual")
TRIED = {"v1": 0, "function": 0}


@st.composite
def dags(draw):
    """A random DAG as plain data (so hypothesis can shrink it).

    Node 0.. are the inputs (1 or 2, all xs) and one constant (not on any path);
    each later node is (op, argument node indices[, weight index]). "concat_split"
    adds two nodes (the two outputs of one split op).
    """
    n_inputs = draw(st.integers(1, 2))
    nodes = [("input", (i,)) for i in range(n_inputs)] + [("constant", ())]
    n_ops = draw(st.integers(1, 12))
    for _ in range(n_ops):
        earlier = st.integers(0, len(nodes) - 1)
        kind = draw(st.sampled_from(("unary", "binary", "matmul", "concat_split")))
        if kind == "unary":
            nodes.append((draw(st.sampled_from(UNARY)), (draw(earlier),)))
        elif kind == "binary":
            nodes.append((draw(st.sampled_from(BINARY)), (draw(earlier), draw(earlier))))
        elif kind == "matmul":
            nodes.append(("matmul", (draw(earlier),), draw(st.integers(0, 1))))
        else:
            args = (draw(earlier), draw(earlier))
            nodes.append(("split0", args))
            nodes.append(("split1", args))
    last = len(nodes) - 1
    ys = sorted(set([last] + draw(st.lists(st.integers(n_inputs, last), max_size=2))))
    weights_are_xs = draw(st.booleans())
    intermediate_x = draw(st.one_of(st.none(), st.integers(n_inputs + 1, last)))
    use_grad_ys = draw(st.booleans())
    stop_gradients = draw(st.one_of(st.just([]), st.lists(st.integers(0, last), max_size=2)))
    # Checkpoint candidates: every node, plus -1 - i for the i-th y (the summed loss).
    candidates = st.integers(-len(ys), last)
    subsets = draw(st.lists(st.lists(candidates, max_size=6, unique=True), min_size=1, max_size=3))
    return {"n_inputs": n_inputs, "nodes": nodes, "ys": ys, "weights_are_xs": weights_are_xs,
            "intermediate_x": intermediate_x, "grad_ys": use_grad_ys, "subsets": subsets,
            "stop_gradients": stop_gradients}


def _apply(op, args):
    if op == "tanh":
        return tf.tanh(args[0])
    if op == "sin":
        return tf.sin(args[0])
    if op == "sigmoid":
        return tf.sigmoid(args[0])
    if op == "scale":
        return args[0] * 0.7
    if op == "square":
        return args[0] * args[0] * 0.5
    if op == "stop_gradient":
        return tf.stop_gradient(args[0])
    if op == "dropout":  # a stateful random draw: recomputation must reuse it
        return tf.nn.dropout(args[0], rate=0.5)
    if op == "add":
        return args[0] + args[1]
    if op == "sub":
        return args[0] - args[1]
    if op == "mul":
        return args[0] * args[1]
    if op == "residual":
        return args[0] + tf.tanh(args[1])
    raise AssertionError(op)


def build_dag(spec, inputs):
    """Builds the DAG of `spec` in the current graph; returns a Case for every subset."""
    weights = [tf.constant((np.random.RandomState(i).uniform(-1, 1, [WIDTH, WIDTH])
                            / np.sqrt(WIDTH)).astype(np.float32)) for i in range(2)]
    tensors = []
    split_of = {}
    for node in spec["nodes"]:
        op, args = node[0], node[1]
        if op == "input":
            tensors.append(inputs[f"x{args[0]}"])
        elif op == "constant":
            tensors.append(tf.sin(tf.ones([BATCH, WIDTH])))
        elif op == "matmul":
            tensors.append(tf.matmul(tensors[args[0]], weights[node[2]]))
        elif op in ("split0", "split1"):
            if args not in split_of or op == "split0":
                joined = tf.concat([tensors[args[0]], tf.tanh(tensors[args[1]])], axis=1)
                split_of[args] = tf.split(joined, 2, axis=1)
            tensors.append(split_of[args][0 if op == "split0" else 1])
        else:
            tensors.append(_apply(op, [tensors[a] for a in args]))
    ys = [tf.reduce_sum(tensors[i] * (1.0 + 0.1 * k)) for k, i in enumerate(spec["ys"])]
    xs = [tensors[i] for i in range(spec["n_inputs"])]
    if spec["weights_are_xs"]:
        xs += weights
    if spec["intermediate_x"] is not None:
        xs.append(tensors[spec["intermediate_x"]])
    kwargs = {}
    if spec["grad_ys"]:
        kwargs["grad_ys"] = [tf.constant(0.5 + k, tf.float32) for k in range(len(ys))]
    if spec.get("stop_gradients"):
        kwargs["stop_gradients"] = [tensors[i] for i in spec["stop_gradients"]]

    def tensor_of(index):
        return ys[-1 - index] if index < 0 else tensors[index]

    lists = [[tensor_of(i) for i in subset] for subset in spec["subsets"]]
    return Case(ys, xs, lists=lists, marks=lists[0], kwargs=kwargs)


def _depends_on_xs(spec):
    """Whether some y is structurally downstream of an x (else memsave refuses)."""
    depends = []
    for index, node in enumerate(spec["nodes"]):
        op, args = node[0], node[1]
        deep = op == "input" or any(depends[a] for a in args) or index == spec["intermediate_x"]
        if op == "matmul" and spec["weights_are_xs"]:
            deep = True
        depends.append(deep)
    return any(depends[i] for i in spec["ys"])


def check_dag(kind, spec):
    feeds = {f"x{i}": np.random.RandomState(10 + i).uniform(-1, 1, [BATCH, WIDTH]).astype(np.float32)
             for i in range(spec["n_inputs"])}
    strategies = [("memory", "memory"), ("speed", "speed"), ("collection", "collection")]
    strategies += [(f"list{i}", None) for i in range(len(spec["subsets"]))]
    sparse = {}
    # (Where no y depends on an x, memsave answers as tf.gradients does: all None.)
    def body(graph, inputs):
        case = build_dag(spec, inputs)
        chosen = [(label, value if value is not None else case.lists[int(label[4:])])
                  for label, value in strategies]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", memsave.MemsaveWarning)
            return build_all(graph, case, chosen, sparse)

    values = evaluate(kind, body, feeds)
    for label, got in values.items():
        if label not in ("tf", "extra"):
            assert_same_gradients(values["tf"], got, rtol=1e-5, label=f"{kind}/{label}")
    TRIED[kind] += 1


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=dags())
def test_random_dags_in_v1_graphs(spec):
    check_dag("v1", spec)


@settings(max_examples=FUNCTION_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(spec=dags())
def test_random_dags_in_tf_function(spec):
    check_dag("function", spec)


def test_a_known_dag_with_every_kind_of_node():
    """One fixed example with every op kind, checkpoints on xs, ys and off the path."""
    spec = {"n_inputs": 2,
            "nodes": [("input", (0,)), ("input", (1,)), ("constant", ()),
                      ("matmul", (0,), 0), ("tanh", (3,)), ("split0", (4, 1)), ("split1", (4, 1)),
                      ("residual", (5, 6)), ("mul", (7, 2)), ("stop_gradient", (4,)),
                      ("sub", (8, 9)), ("sin", (4,)), ("matmul", (10,), 1), ("dropout", (12,))],
            "ys": [11, 13], "weights_are_xs": True, "intermediate_x": 4, "grad_ys": True,
            "subsets": [[4, 7], [0, -1, 2, 11], [5, 6, 8, 10, 12]], "stop_gradients": [6]}
    for kind in ("v1", "function"):
        check_dag(kind, spec)


@pytest.fixture(scope="module", autouse=True)
def _report_examples():
    yield
    # Shown with `pytest -s` (or in the captured output of a failure).
    print(f"\nmemsave property tests: DAGs tried: v1={TRIED['v1']}, tf.function={TRIED['function']}")
