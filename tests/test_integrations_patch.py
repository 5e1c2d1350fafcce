"""memsave.patch: routes tf.gradients, tf.compat.v1.gradients and v1 optimizers through memsave.

Each test compares against the unpatched tf.gradients on the same graph; the
memory test measures peak bytes of a v1 `minimize` step in separate processes.
"""

import concurrent.futures
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients as tf_gradients_module
from tensorflow.python.ops import gradients_impl

import memsave
from memsave import rewrite
from memsave.integrations import patch as patch_module
from memsave.measure import run_isolated

from _models import tanh_mlp_loss

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHILD_ENV = {"PYTHONPATH": os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")])}


def _slots():
    """(owner, 'gradients' in its __dict__, the value) for every patched site."""
    owners = patch_module._sites()
    return [(owner, "gradients" in vars(owner), vars(owner).get("gradients")) for owner in owners]


def _assert_unpatched(before):
    after = _slots()
    assert len(after) == len(before)
    for (owner_a, present_a, value_a), (owner_b, present_b, value_b) in zip(before, after):
        assert owner_a is owner_b
        assert present_a == present_b
        assert value_a is value_b, f"{owner_a.__name__}.gradients not restored"
    assert tf.gradients is gradients_impl.gradients_v2
    assert tf.compat.v1.gradients is gradients_impl.gradients
    assert tf_gradients_module.gradients is gradients_impl.gradients
    assert patch_module.active_checkpoints() is None


@pytest.fixture
def spy(monkeypatch):
    """Records the `checkpoints` of every memsave.gradients call (and calls it)."""
    calls = []
    real = rewrite.gradients

    def recording(ys, xs, grad_ys=None, checkpoints="collection", **kwargs):
        calls.append(checkpoints)
        return real(ys, xs, grad_ys, checkpoints=checkpoints, **kwargs)

    monkeypatch.setattr(rewrite, "gradients", recording)
    return calls


def _mlp_graph(depth=6, width=8, batch=4, seed=0):
    """A small tanh MLP in the current v1 graph: (feed, loss, variables)."""
    rng = np.random.RandomState(seed)
    x = tf.compat.v1.placeholder(tf.float32, (batch, width), name="x")
    h = x
    variables = []
    for i in range(depth):
        w = tf.Variable((rng.randn(width, width) / np.sqrt(width)).astype(np.float32), name=f"w{i}")
        variables.append(w)
        h = tf.tanh(tf.matmul(h, w))
        if i % 2 == 1:
            memsave.mark_checkpoint(h)
    loss = tf.reduce_sum(h * h)
    return {x: rng.randn(batch, width).astype(np.float32)}, loss, variables


def _evaluate(graph, fetches, feed):
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return sess.run(fetches, feed)


def test_import_has_no_side_effects():
    # `import tensorflow` itself may import parts of Keras; memsave must add none.
    code = (
        "import sys, tensorflow as tf\n"
        "keras_before = {m for m in sys.modules if m.split('.')[0] == 'keras'}\n"
        "import memsave\n"
        "from tensorflow.python.ops import gradients as g, gradients_impl as gi\n"
        "assert tf.gradients is gi.gradients_v2, tf.gradients\n"
        "assert tf.compat.v1.gradients is gi.gradients\n"
        "assert g.gradients is gi.gradients\n"
        "keras_after = {m for m in sys.modules if m.split('.')[0] == 'keras'}\n"
        "assert keras_after == keras_before, sorted(keras_after - keras_before)[:5]\n"
        "assert 'memsave.integrations.keras' not in sys.modules\n"
        "print('clean')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "clean" in proc.stdout


def test_patch_routes_all_three_and_restores(spy):
    before = _slots()
    graph = tf.Graph()
    with graph.as_default():
        feed, loss, variables = _mlp_graph()
        reference = tf.gradients(loss, variables)
        with memsave.patch(checkpoints="collection") as active:
            assert isinstance(active, memsave.patch)
            assert tf.gradients is not gradients_impl.gradients_v2
            v2 = tf.gradients(loss, variables)
            v1 = tf.compat.v1.gradients(loss, variables)
            sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            grads_and_vars = sgd.compute_gradients(loss, var_list=variables)
            # The two signatures differ from the 5th positional on (gate_gradients
            # vs colocate_gradients_with_ops): both must still be understood.
            v2_positional = tf.gradients(loss, variables, None, "g2", True)
            v1_positional = tf.compat.v1.gradients(loss, variables, None, "g1", True, True)
        assert spy == ["collection"] * 5
        _assert_unpatched(before)
        values = _evaluate(graph, [reference, v2, v1, [g for g, _ in grads_and_vars],
                                   v2_positional, v1_positional], feed)
    for got in values[1:]:
        for expected, actual in zip(values[0], got):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_patched_minimize_matches_unpatched_losses(spy):
    def train(patched):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.set_random_seed(0)
            feed, loss, _ = _mlp_graph(seed=1)
            opt = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)
            if patched:
                with memsave.patch(checkpoints="memory"):
                    train_op = opt.minimize(loss)
            else:
                train_op = opt.minimize(loss)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return [sess.run([loss, train_op], feed)[0] for _ in range(4)]

    plain = train(False)
    assert spy == []
    memsaved = train(True)
    assert spy == ["memory"]
    np.testing.assert_allclose(memsaved, plain, rtol=1e-5)
    assert plain[-1] < plain[0]


def test_restores_when_body_raises(spy):
    before = _slots()
    with pytest.raises(KeyError, match="boom"):
        with memsave.patch(checkpoints="speed"):
            assert patch_module.active_checkpoints() == "speed"
            raise KeyError("boom")
    _assert_unpatched(before)


def test_nested_inner_wins_outer_restored(spy):
    before = _slots()
    graph = tf.Graph()
    with graph.as_default():
        _, loss, variables = _mlp_graph()
        with memsave.patch(checkpoints="memory"):
            tf.gradients(loss, variables)
            with memsave.patch(checkpoints="speed"):
                tf.gradients(loss, variables)
                with pytest.raises(RuntimeError):
                    with memsave.patch(checkpoints="collection"):
                        tf.compat.v1.gradients(loss, variables)
                        raise RuntimeError("inner failure")
                tf.compat.v1.gradients(loss, variables)
            tf.gradients(loss, variables)
    assert spy == ["memory", "speed", "collection", "speed", "memory"]
    _assert_unpatched(before)


def test_patching_twice_is_harmless(spy):
    before = _slots()
    same = memsave.patch(checkpoints="memory")
    graph = tf.Graph()
    with graph.as_default():
        _, loss, variables = _mlp_graph()
        with same, same, memsave.patch(checkpoints="memory"):
            assert patch_module.active_checkpoints() == "memory"
            tf.gradients(loss, variables)
        _assert_unpatched(before)
        with same:
            assert tf.gradients is not gradients_impl.gradients_v2
            tf.gradients(loss, variables)
    assert spy == ["memory", "memory"]
    _assert_unpatched(before)


def test_decorator_and_recursion(spy):
    before = _slots()

    @memsave.patch(checkpoints="speed")
    def build(depth):
        assert patch_module.active_checkpoints() == "speed"
        if depth:
            return build(depth - 1)
        graph = tf.Graph()
        with graph.as_default():
            feed, loss, variables = _mlp_graph()
            return graph, feed, tf.gradients(loss, variables), variables, loss

    graph, feed, grads, variables, loss = build(2)
    _assert_unpatched(before)
    assert spy == ["speed"]
    with graph.as_default():
        reference = tf.gradients(loss, variables)
    got, expected = _evaluate(graph, [grads, reference], feed)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_memsave_reaches_the_real_tf_gradients_while_patched(monkeypatch):
    """memsave's own segment calls must not loop back into memsave."""
    outer_calls = []
    real = rewrite.gradients

    def recording(*args, **kwargs):
        outer_calls.append(1)
        assert len(outer_calls) < 5, "memsave re-entered itself through the patch"
        return real(*args, **kwargs)

    monkeypatch.setattr(rewrite, "gradients", recording)
    graph = tf.Graph()
    with graph.as_default():
        feed, loss, variables = _mlp_graph()
        with memsave.patch(checkpoints="memory"):
            assert patch_module.original_gradients() is gradients_impl.gradients_v2
            grads = tf.gradients(loss, variables)
        reference = tf.gradients(loss, variables)
        got, expected = _evaluate(graph, [grads, reference], feed)
    assert len(outer_calls) == 1
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Whatever the rewrite holds as "the real tf.gradients" must be the original.
    held = getattr(rewrite, "_tf_gradients", None)
    assert getattr(held, "memsave_original", None) is None


def test_patched_in_tf_function_matches():
    x_value = np.random.RandomState(3).randn(8, 16).astype(np.float32)
    weights = [tf.Variable(np.random.RandomState(i).randn(16, 16).astype(np.float32) * 0.3)
               for i in range(5)]

    def loss_of(x):
        return tanh_mlp_loss(x, weights)

    @tf.function
    def plain(x):
        return tf.gradients(loss_of(x), weights)

    @tf.function
    @memsave.patch(checkpoints="memory")
    def patched(x):
        return tf.gradients(loss_of(x), weights)

    for a, b in zip(patched(x_value), plain(x_value)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert patch_module.active_checkpoints() is None


def test_bad_strategy_is_refused_early_in_the_words_of_memsave_gradients():
    with pytest.raises(memsave.MemsaveError, match="memsave: unknown checkpoints strategy 'fast'"):
        memsave.patch(checkpoints="fast")
    with pytest.raises(memsave.MemsaveError, match="checkpoints is a NoneType"):
        memsave.patch(checkpoints=None)
    assert patch_module.active_checkpoints() is None
    # One text, naming every accepted form, wherever a strategy is given.
    texts = set()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2])
        for call in (lambda: memsave.patch(checkpoints="fastest"),
                     lambda: memsave.gradient_function("fastest"),
                     lambda: memsave.gradients(tf.reduce_sum(tf.tanh(x)), [x],
                                               checkpoints="fastest")):
            with pytest.raises(memsave.MemsaveError) as refused:
                call()
            texts.add(str(refused.value))
    [text] = texts
    for form in ("a list of tensors", "'memory'", "memsave.budget(limit)", "strategy callable"):
        assert form in text, text


# ---------------------------------------------------------------- memory
DEPTH, BATCH, WIDTH = 24, 1024, 256


def measure_v1_minimize_peak(patched, depth=DEPTH, batch=BATCH, width=WIDTH):
    """Runs in a fresh process: peak bytes of one v1 `minimize` step, and its losses."""
    import tensorflow as tf  # noqa: F811 (fresh process)

    import memsave as ms
    from memsave.measure import peak_memory_bytes

    tf.compat.v1.disable_eager_execution()
    rng = np.random.RandomState(0)
    x = tf.compat.v1.placeholder(tf.float32, (batch, width))
    h = x
    for i in range(depth):
        w = tf.Variable((rng.randn(width, width) / np.sqrt(width)).astype(np.float32), name=f"w{i}")
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_mean(h * h)
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    if patched:
        with ms.patch(checkpoints="memory"):
            train_op = opt.minimize(loss)
    else:
        train_op = opt.minimize(loss)
    feed = {x: rng.randn(batch, width).astype(np.float32)}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [float(sess.run([loss, train_op], feed)[0])]  # warm-up step
        peak, value = peak_memory_bytes(lambda: sess.run([loss, train_op], feed))
        losses.append(float(value[0]))
    return {"peak": int(peak), "losses": losses}


@pytest.mark.measures
def test_patched_minimize_saves_memory():
    target = f"{__name__}:measure_v1_minimize_peak"
    # One process per configuration, both at once (peaks are per process).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain, patched = pool.map(
            lambda patched: run_isolated(target, timeout=240, env=CHILD_ENV, patched=patched),
            [False, True])
    np.testing.assert_allclose(patched["losses"], plain["losses"], rtol=1e-5)
    ratio = patched["peak"] / plain["peak"]
    print(f"v1 minimize peak: plain {plain['peak'] / 2**20:.1f} MiB, "
          f"patched {patched['peak'] / 2**20:.1f} MiB, ratio {ratio:.2f}")
    assert ratio < 0.75, (plain, patched)


def test_patch_takes_a_budget():
    x_value = np.random.RandomState(4).uniform(-1, 1, [256, 256]).astype(np.float32)

    def loss_of(x):
        h = x
        for _ in range(16):
            h = tf.tanh(h)
        return tf.reduce_sum(h * h)

    @tf.function
    def plain(x):
        return tf.gradients(loss_of(x), [x])

    @tf.function
    @memsave.patch(checkpoints=memsave.budget(0.6))
    def patched(x):
        return tf.gradients(loss_of(x), [x])

    np.testing.assert_allclose(patched(x_value)[0].numpy(), plain(x_value)[0].numpy(),
                               rtol=1e-5, atol=1e-6)
    report = memsave.last_report()
    assert report.strategy == "budget(0.6)" and report.segments
    assert report.predicted_peak_bytes <= 0.6 * report.baseline_peak_bytes
