"""Shared fixtures: run the same graph-building code in both kinds of TF graph.

`run_graph(build, feeds)` is parametrized over the two graph kinds memsave
supports: a `tf.compat.v1` Graph run in a Session, and the body of a
`tf.function` (a FuncGraph, where tensors are unhashable). `build(graph, inputs)`
builds (and may inspect or edit) the graph; what it returns is evaluated and
handed back as numpy values.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

GRAPH_KINDS = ("v1", "function")

# TensorFlow 1 behaviour for the whole process (v1 control flow, ref variables, no eager):
# set by tests/test_parity.py for a child pytest run.
V1_BEHAVIOUR_ENV = "MEMSAVE_TEST_V1_BEHAVIOUR"
if os.environ.get(V1_BEHAVIOUR_ENV) == "1":
    tf.compat.v1.disable_v2_behavior()


def _run_v1(build, feeds):
    graph = tf.Graph()
    with graph.as_default():
        inputs = {name: tf.compat.v1.placeholder(tf.as_dtype(value.dtype), value.shape, name=name)
                  for name, value in feeds.items()}
        fetches = build(graph, inputs)
        if fetches is None:
            return None
        with tf.compat.v1.Session(graph=graph) as session:
            return session.run(fetches, {inputs[name]: value for name, value in feeds.items()})


def _run_function(build, feeds):
    names = list(feeds)
    signature = [tf.TensorSpec(feeds[name].shape, tf.as_dtype(feeds[name].dtype), name=name)
                 for name in names]

    @tf.function(autograph=False, input_signature=signature)
    def body(*args):
        return build(tf.compat.v1.get_default_graph(), dict(zip(names, args)))

    result = body(*[tf.constant(feeds[name]) for name in names])
    return tf.nest.map_structure(lambda t: None if t is None else t.numpy(), result)


def run_in_graph(kind, build, feeds=None):
    """Builds with `build(graph, inputs)` in a graph of `kind` and evaluates what it returns.

    Args:
      kind: "v1" (tf.compat.v1 Graph + Session) or "function" (tf.function body).
      build: a callable `(graph, inputs) -> fetches`; `inputs` maps each feed
        name to a placeholder (v1) or a function argument (also a Placeholder op).
        Fetches may be any nest of tensors, or None.
      feeds: a dict from input name to numpy array (fixes dtype and shape).
    Returns:
      The fetches as numpy values (same nesting), or None.
    """
    feeds = {name: np.asarray(value) for name, value in (feeds or {}).items()}
    if kind == "v1":
        return _run_v1(build, feeds)
    if kind == "function":
        return _run_function(build, feeds)
    raise ValueError(f"unknown graph kind {kind!r}; expected one of {GRAPH_KINDS}")


@pytest.fixture(params=GRAPH_KINDS)
def graph_kind(request):
    """The graph kind of this test run: "v1" or "function"."""
    return request.param


@pytest.fixture
def run_graph(graph_kind):
    """`run_graph(build, feeds=None)`: `run_in_graph` bound to this run's graph kind."""

    def run(build, feeds=None):
        return run_in_graph(graph_kind, build, feeds)

    run.kind = graph_kind
    return run


def build_classic_graph():
    """The reference graph of the SPEC, built in the current default graph.

    `a` const; scope `foo`: `b` const, `c = a + b`, `d` const; scope `foo/bar`:
    `e = c + d`, `f = c + d`, `g = c + a`, `h = f + g` with a control input on `c`.

    Returns:
      A dict from the short names "a".."h" to their tensors.
    """
    t = {"a": tf.constant(1.0, name="a")}
    with tf.name_scope("foo"):
        t["b"] = tf.constant(2.0, name="b")
        t["c"] = tf.add(t["a"], t["b"], name="c")
        t["d"] = tf.constant(3.0, name="d")
        with tf.name_scope("bar"):
            t["e"] = tf.add(t["c"], t["d"], name="e")
            t["f"] = tf.add(t["c"], t["d"], name="f")
            t["g"] = tf.add(t["c"], t["a"], name="g")
            with tf.control_dependencies([t["c"].op]):
                t["h"] = tf.add(t["f"], t["g"], name="h")
    return t


@pytest.fixture
def classic_graph():
    """`build_classic_graph` as a fixture: call it inside a graph to build there."""
    return build_classic_graph


@pytest.fixture(autouse=True)
def _rewrite_small_graphs(request, monkeypatch):
    """Most tests check the rewrite itself on graphs too small to save memory, where
    memsave would fall back to plain tf.gradients; tests marked `planner_fallback`
    see the default behaviour. Child processes inherit the setting through the
    environment."""
    import memsave
    from memsave.environment import ALWAYS_REWRITE_ENV
    if request.node.get_closest_marker("planner_fallback"):
        monkeypatch.delenv(ALWAYS_REWRITE_ENV, raising=False)
        yield
        return
    monkeypatch.setenv(ALWAYS_REWRITE_ENV, "1")
    with memsave.always_rewrite():
        yield


# --- measurements shared by pytest-xdist's workers (tests/_shared_runs.py) ---------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (`pytest -n 2`), a test marked `measures` (a peak, a time or a
    deadline it asserts on) runs while no other test runs; the others run side by side.
    Around the whole test, the setup of its module's fixtures included (a module
    fixture that measures, or builds a virtual environment, runs inside the lock).

    Only in a worker itself: a pytest a test starts in a child process (test_parity's)
    inherits the worker's environment, and taking the lock there while its parent test
    holds it could wait on a measuring test that waits on the parent."""
    from _shared_runs import alone_or_beside_others, worker_run_id
    run_id = worker_run_id(item.config)
    if not run_id:
        yield
        return
    with alone_or_beside_others(run_id, item.get_closest_marker("measures") is not None):
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist, on the controller) Remembers the run's id, to clean up after it."""
    node.config._memsave_run_id = node.workerinput.get("testrunuid")


def pytest_sessionfinish(session):
    run_id = getattr(session.config, "_memsave_run_id", None)
    if run_id:
        from _shared_runs import remove_run_directory
        remove_run_directory(run_id)
